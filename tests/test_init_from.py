"""Starting from an existing drafter: z-lab's and speculators' formats and this project's
exports load exactly, are checked against the params and the target, and export unchanged."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    repeat_kv,
    rotate_half,
)

from dflash.commands.report import drafter_sources
from dflash.config.schema import DrafterConfig
from dflash.errors import ConfigError
from dflash.metrics.schema import TrainDetails
from dflash.model import shipped
from dflash.model.drafter import DFlashDrafter
from dflash.model.export import export_drafter
from dflash.model.imported import checkpoint_weights, read_checkpoint
from dflash.train.init_drafter import TargetShape, checked_checkpoint

LAYERS = {
    "model_type": "qwen3", "vocab_size": 300, "hidden_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "num_hidden_layers": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
}  # fmt: skip
"""A tiny drafter for ``tiny_qwen3`` (hidden 32, vocab 300, 6 layers)."""
TINY_TARGET = {"num_hidden_layers": 6}
"""The module's ``target`` (conftest.py): :func:`tiny_qwen3` of these keywords."""
IDS, MASK, BLOCK = [1, 3], 299, 4
TARGET = TargetShape(depth=6, hidden_size=32, vocab_size=300, mask_token_id=MASK, mask_token="m")


class ZLabAttention(nn.Module):
    """z-lab's ``Qwen3DFlashAttention`` in eager form: keys and values of the context then the
    block through the same projections, per-head QK-norm, rope with the queries at the block's
    (last) positions, no mask."""

    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        d, h, kv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        self.d, self.groups = d, h // kv
        self.q_proj = nn.Linear(c.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(d, eps=c.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=c.rms_norm_eps)

    def forward(self, x, context, cos, sin):
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, -1, self.d)).transpose(1, 2)
        both = torch.cat([context, x], dim=1)
        k = self.k_norm(self.k_proj(both).view(b, both.shape[1], -1, self.d)).transpose(1, 2)
        v = self.v_proj(both).view(b, both.shape[1], -1, self.d).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        weights = torch.softmax(q @ k.transpose(2, 3) * self.d**-0.5, dim=-1)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(b, q_len, -1))


class ZLabLayer(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = ZLabAttention(c)
        self.mlp = Qwen3MLP(c)
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, x, context, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class ZLabDraftModel(nn.Module):
    """The forward of z-lab's ``DFlashDraftModel`` (model/dflash.py), built from transformers'
    own Qwen3 modules, under its parameter names."""

    def __init__(self, c: Qwen3Config, n_features: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ZLabLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(c)
        self.fc = nn.Linear(n_features * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, noise_embedding, target_hidden, position_ids):
        context = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, context, cos, sin)
        return self.norm(x)


@pytest.fixture(scope="module")
def reference() -> ZLabDraftModel:
    torch.manual_seed(1)
    model = ZLabDraftModel(Qwen3Config(**LAYERS), len(IDS)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(std=0.1)
    return model


def write_zlab(directory: Path, model: nn.Module, **changes) -> Path:
    """A checkpoint as z-lab publishes one: the block size inside ``dflash_config`` (newer
    files), no embedding or head."""
    directory.mkdir(parents=True)
    config = {"architectures": ["DFlashDraftModel"], **LAYERS, "num_target_layers": 6,
              "dflash_config": {"block_size": BLOCK, "target_layer_ids": IDS,
                                "mask_token_id": MASK}} | changes  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, directory / "model.safetensors"
    )
    return directory


def write_speculators(directory: Path, model: nn.Module) -> Path:
    """A checkpoint as speculators saves a full-vocabulary DFlash drafter: the layer config
    nested, the tapped layers counted from the embedding, the mask id at the top."""
    directory.mkdir(parents=True)
    config = {
        "speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": LAYERS, "draft_vocab_size": 300, "block_size": BLOCK,
        "aux_hidden_state_layer_ids": [i + 1 for i in IDS], "mask_token_id": MASK,
        "speculators_config": {"algorithm": "dflash", "verifier": {"name_or_path": "t"}},
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    weights["verifier_norm.weight"] = torch.ones(32)  # the target's: left out on import
    save_file(weights, directory / "model.safetensors")
    return directory


def imported(directory: Path, target) -> DFlashDrafter:
    checkpoint = read_checkpoint(directory)
    config = checkpoint.drafter_config(6, None)
    return DFlashDrafter.from_weights(config, checkpoint_weights(checkpoint), target).eval()


def micro_batch(target):
    """A block after 10 context tokens, its target features and positions."""
    torch.manual_seed(2)
    block = torch.tensor([[7, MASK, MASK, MASK], [9, MASK, MASK, MASK]])
    features = torch.randn(2, 10, len(IDS) * 32)
    context_positions = torch.arange(10).expand(2, 10)
    block_positions = torch.arange(10, 10 + BLOCK).expand(2, BLOCK)
    return block, block_positions, features, context_positions


def trainer_logits(drafter: DFlashDrafter, batch) -> torch.Tensor:
    with torch.no_grad():
        return drafter.logits(drafter(*batch))


def test_zlab_checkpoint_gives_the_reference_logits(target, reference, tmp_path):
    drafter = imported(write_zlab(tmp_path / "zlab", reference), target)
    block, block_positions, features, context_positions = batch = micro_batch(target)
    positions = torch.cat([context_positions, block_positions], dim=1)
    with torch.no_grad():
        hidden = reference(target.get_input_embeddings()(block), features, positions)
        expected = target.get_output_embeddings()(hidden)
    assert (trainer_logits(drafter, batch) - expected).abs().max() <= 1e-5
    assert drafter.config.block_size == BLOCK and drafter.config.target_layer_ids == IDS


def test_speculators_checkpoint_is_the_same_drafter(target, reference, tmp_path):
    zlab = imported(write_zlab(tmp_path / "zlab", reference), target)
    spec = imported(write_speculators(tmp_path / "spec", reference), target)
    assert spec.config.target_layer_ids == IDS and spec.config.mask_token_id == MASK
    batch = micro_batch(target)
    assert torch.equal(trainer_logits(spec, batch), trainer_logits(zlab, batch))


def test_export_gives_the_logits_of_its_own_dflash_py(target, tmp_path):
    drafter = DFlashDrafter.from_target(
        target, block_size=BLOCK, num_hidden_layers=2, num_target_features=2, mask_token_id=MASK
    )
    export_drafter(drafter, tmp_path / "export", target.config, torch.float32)
    again = imported(tmp_path / "export", target)
    served = shipped.DFlashDraftModel.from_pretrained(tmp_path / "export").eval()
    block, block_positions, features, context_positions = batch = micro_batch(target)
    positions = torch.cat([context_positions, block_positions], dim=1)
    with torch.no_grad():
        hidden = served(target.get_input_embeddings()(block), features, positions)
        expected = target.get_output_embeddings()(hidden)
    assert (trainer_logits(again, batch) - expected).abs().max() <= 1e-5


def test_an_imported_drafter_exports_unchanged(target, reference, tmp_path):
    source = write_zlab(tmp_path / "zlab", reference)
    export_drafter(imported(source, target), tmp_path / "out", target.config, torch.float32)
    before, after = (
        load_file(source / "model.safetensors"),
        load_file(tmp_path / "out/model.safetensors"),
    )
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert config["block_size"] == BLOCK and config["num_target_layers"] == 6
    assert config["dflash_config"]["target_layer_ids"] == IDS
    assert config["dflash_config"]["mask_token_id"] == MASK


@pytest.mark.parametrize(
    ("params", "target", "named"),
    [
        (
            {"num_hidden_layers": 1},
            TARGET,
            "drafter.num_hidden_layers = 1 but the checkpoint has 2",
        ),
        ({"block_size": 16}, TARGET, "drafter.block_size = 16 but the checkpoint has 4"),
        ({}, TargetShape(6, 64, 300, MASK, "m"), "hidden size 32, the target's is 64"),
        ({}, TargetShape(3, 32, 300, MASK, "m"), "target_layer_ids [1, 3], beyond the target's 3"),
        ({}, TargetShape(6, 32, 400, MASK, "m"), "vocabulary 300, the target's is 400"),
        ({}, TargetShape(6, 32, 300, 5, "<|MASK|>"), "mask token id 299, the tokenizer's"),
    ],
)
def test_a_mismatch_names_both_values(reference, tmp_path, params, target, named):
    source = write_zlab(tmp_path / "zlab", reference)
    params = {"block_size": BLOCK, "num_hidden_layers": None, "num_target_features": None} | params
    d = DrafterConfig(init_from=str(source), **params)
    with pytest.raises(ConfigError) as err:
        checked_checkpoint(d, source, target)
    assert named in str(err.value)


def test_what_the_trainer_would_compute_otherwise_is_refused(reference, tmp_path):
    scaled = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    for name, change in [("bias", {"attention_bias": True}), ("rope", scaled)]:
        source = write_zlab(tmp_path / name, reference, **change)
        with pytest.raises(ConfigError, match="the trainer's drafter has"):
            read_checkpoint(source)


def test_null_params_follow_the_checkpoint(reference, tmp_path):
    source = write_zlab(tmp_path / "zlab", reference)
    d = DrafterConfig(init_from=str(source), block_size=BLOCK, num_hidden_layers=None,
                      num_target_features=2)  # fmt: skip
    _, sources = checked_checkpoint(d, source, TARGET)
    assert sources["num_hidden_layers"] == "2 (checkpoint)"
    assert sources["num_target_features"] == "2 (params = checkpoint)"


def test_report_says_where_each_value_came_from():
    sources = {"block_size": "4 (params = checkpoint)", "num_hidden_layers": "2 (checkpoint)",
               "init_from": "models/init/zlab (z-lab)"}  # fmt: skip
    lines = drafter_sources(TrainDetails.model_construct(drafter_sources=sources))
    text = " ".join(line.strip() for line in lines)
    assert text.startswith("drafter from models/init/zlab (z-lab): block_size 4 (params =")
    assert "num_hidden_layers 2 (checkpoint)" in text and all(len(x) <= 80 for x in lines)


def weights_of(model: nn.Module, **changes: float) -> dict[str, torch.Tensor]:
    """``model``'s weights with the first value of each named one replaced."""
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for name, value in changes.items():
        weights[name.replace("__", ".")].view(-1)[0] = value
    return weights


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_weight_that_is_not_finite_is_refused_by_name(reference, tmp_path, bad):
    source = write_zlab(tmp_path / "zlab", reference)
    save_file(weights_of(reference, fc__weight=bad), source / "model.safetensors")
    d = DrafterConfig(init_from=str(source), block_size=BLOCK, num_hidden_layers=None,
                      num_target_features=None)  # fmt: skip
    named = f"weight fc.weight in {source / 'model.safetensors'} holds 1 NaN or infinite value"
    with pytest.raises(ConfigError, match=re.escape(named)):
        checked_checkpoint(d, source, TARGET)
    with pytest.raises(ConfigError, match=re.escape(named)):
        checkpoint_weights(read_checkpoint(source))


def test_a_cut_short_weights_file_or_a_config_that_is_no_object_is_refused_naming_it(
    reference, tmp_path
):
    d = DrafterConfig(init_from="x", block_size=BLOCK, num_hidden_layers=None,
                      num_target_features=None)  # fmt: skip
    source = write_zlab(tmp_path / "cut", reference)
    whole = (source / "model.safetensors").read_bytes()
    (source / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ConfigError, match=re.escape(f"{source / 'model.safetensors'} is no read")):
        checked_checkpoint(d, source, TARGET)
    (source / "model.safetensors").unlink()
    (source / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ConfigError, match="model.safetensors.index.json is no safetensors index"):
        checked_checkpoint(d, source, TARGET)
    for text, kind in (("[1, 2]", "an array"), ('"zlab"', "a string"), ("null", "null")):
        (source / "config.json").write_text(text)
        with pytest.raises(ConfigError, match=f"config.json holds {kind}, not the JSON object"):
            read_checkpoint(source)
    (source / "config.json").write_text(json.dumps({**LAYERS, "dflash_config": [1]}))
    with pytest.raises(ConfigError, match=re.escape("config.json has dflash_config = [1], not an")):
        read_checkpoint(source)


def write_block(directory: Path, model: nn.Module, fmt: str, key: str, value) -> Path:
    """A checkpoint of ``fmt`` whose block size, under ``key``, is ``value``."""
    source = (write_zlab if fmt == "z-lab" else write_speculators)(directory, model)
    config = json.loads((source / "config.json").read_text())
    config.get("dflash_config", {}).pop("block_size", None)
    config.pop("block_size", None)
    inner = key.startswith("dflash_config.")
    (config["dflash_config"] if inner else config)[key.split(".")[-1]] = value
    (source / "config.json").write_text(json.dumps(config))
    return source


@pytest.mark.parametrize(
    ("fmt", "key", "value"),
    [
        ("speculators", "block_size", 0),
        ("speculators", "block_size", -4),
        ("speculators", "block_size", 1),
        ("z-lab", "block_size", 0),
        ("z-lab", "dflash_config.block_size", 0),
        ("z-lab", "block_size", -4),
        ("z-lab", "dflash_config.block_size", True),
        ("z-lab", "block_size", "8"),
    ],
)
def test_a_block_size_below_two_or_not_a_whole_number_is_refused(
    reference, tmp_path, fmt, key, value
):
    source = write_block(tmp_path / "ckpt", reference, fmt, key, value)
    with pytest.raises(ConfigError) as err:
        read_checkpoint(source)
    assert str(err.value) == (
        f"drafter.init_from = {str(source)!r} ({fmt}): config.json has {key} = {value!r}, which "
        "is invalid: a block is the anchor and at least one drafted token, a whole number >= 2"
    )


def test_a_speculators_file_without_a_block_size_gets_speculators_default(reference, tmp_path):
    source = write_speculators(tmp_path / "spec", reference)
    config = json.loads((source / "config.json").read_text())
    del config["block_size"]
    (source / "config.json").write_text(json.dumps(config))
    assert read_checkpoint(source).block_size == 8
    zlab = write_block(tmp_path / "zlab", reference, "z-lab", "dflash_config.block_size", 6)
    assert read_checkpoint(zlab).block_size == 6
