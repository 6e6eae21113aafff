"""Packed rows are exact for the targets users bring: a packed row of three documents gives each
document the features the plain Hugging Face forward gives it alone, whichever way it goes
(document attention, or one document per row for targets that mix tokens otherwise)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers as tf
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from dflash.features.target_forward import decoder_layers, target_features
from dflash.model import document_layout, target_attention
from dflash.model.document_layout import DocumentLayout
from dflash.model.mixing import by_document_rows, mixers, pointwise, unconfined
from dflash.model.shipped import select_features
from dflash.train.distributed.parallel import shard_target

LENGTHS = [9, 14, 7]
"""Three documents in one row: longer than the sliding windows below, so tiles run too."""

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4)
SMALL |= dict(num_key_value_heads=2, head_dim=8, num_hidden_layers=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def llama():
    return tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL))


def qwen3_moe():
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**SMALL, **MOE))


def gemma3():
    kinds = ["sliding_attention", "full_attention"] * 2
    config = tf.Gemma3TextConfig(**SMALL, sliding_window=4, layer_types=kinds)
    return tf.Gemma3ForCausalLM(config)


def gpt_oss():
    kinds = ["sliding_attention", "full_attention"] * 2
    config = tf.GptOssConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, layer_types=kinds
    )
    model = tf.GptOssForCausalLM(config)
    for layer in decoder_layers(model):  # sinks of either sign and size, not their init's 0s
        nn.init.normal_(layer.self_attn.sinks, std=2.0)
    return model


def qwen3_next():
    config = tf.Qwen3NextConfig(
        **SMALL,
        **MOE,
        shared_expert_intermediate_size=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"] * 2,
    )
    return tf.Qwen3NextForCausalLM(config)


def gemma2():
    """Soft-capped attention logits: the kernel does not apply them, so this target's packed
    rows go one document per row once its attention refuses."""
    return tf.Gemma2ForCausalLM(tf.Gemma2Config(**SMALL, sliding_window=4))


def deepseek_v3():
    """Multi-head latent attention: values narrower than queries and keys."""
    config = tf.DeepseekV3Config(
        **(SMALL | {"num_key_value_heads": 4}),
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    )
    return tf.DeepseekV3ForCausalLM(config)


def stablelm():
    """Its attention does not pass the model's keyword arguments on: no layout reaches it."""
    return tf.StableLmForCausalLM(tf.StableLmConfig(**SMALL))


TARGETS = {
    "llama": (llama, "documents"),
    "qwen3_moe": (qwen3_moe, "documents"),
    "gemma3": (gemma3, "documents"),
    "gpt_oss": (gpt_oss, "documents"),
    "qwen3_next": (qwen3_next, "rows"),
    "gemma2": (gemma2, "rows"),
    "deepseek_v3": (deepseek_v3, "documents"),
    "stablelm": (stablelm, "rows"),
}
LAYERS = [0, 1, 2]


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = TARGETS[name][0]().eval()
    for p in model.parameters():  # weights past their tiny init, so a leak would show
        p.data.add_(torch.randn_like(p) * 0.02)
    return model


def packed_row(vocab: int):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (1, sum(LENGTHS)), generator=gen)
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(LENGTHS)])[None]
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return ids, pos, docs


def alone(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Each document through the plain Hugging Face forward, its features laid back in a row."""
    parts, start = [], 0
    with torch.no_grad():
        for n in LENGTHS:
            out = model(input_ids=ids[:, start : start + n], output_hidden_states=True)
            parts.append(select_features(out.hidden_states, LAYERS))
            start += n
    return torch.cat(parts, dim=1)


def path_taken(model, ids, pos, docs, monkeypatch) -> str:
    ran = []
    kernel = target_attention.attention

    def spy(*args, **kwargs):
        ran.append(True)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(target_attention, "attention", spy)
    tf.AttentionInterface.register(target_attention.NAME, spy)
    try:
        target_features(model, ids, pos, docs, LAYERS)
    finally:
        tf.AttentionInterface.register(target_attention.NAME, kernel)
    return "documents" if ran and not unconfined(model, decoder_layers(model), 3) else "rows"


@pytest.mark.parametrize("name", list(TARGETS))
def test_a_packed_row_gives_each_document_its_own_features(name, monkeypatch):
    model = build(name)
    ids, pos, docs = packed_row(model.config.vocab_size)
    want = alone(model, ids)
    got = target_features(model, ids, pos, docs, LAYERS)
    assert (got - want).abs().max() <= 1e-5
    assert path_taken(model, ids, pos, docs, monkeypatch) == TARGETS[name][1]


@pytest.mark.parametrize("name", ["gpt_oss", "gemma3"])
def test_small_tiles_and_length_classes_change_nothing(name, monkeypatch):
    """Tiles of several key widths and documents in several length classes, sinks included."""
    monkeypatch.setattr(document_layout, "QUERY_TILE", 4)
    monkeypatch.setattr(document_layout, "LENGTH_STEP", 4)
    model = build(name)
    ids, pos, docs = packed_row(model.config.vocab_size)
    got = target_features(model, ids, pos, docs, LAYERS)
    assert (got - alone(model, ids)).abs().max() <= 1e-5


def test_sinks_change_the_features():
    """The sink is merged, not dropped: zero sinks (the kernel without them) give other outputs."""
    model = build("gpt_oss")
    ids, pos, docs = packed_row(model.config.vocab_size)
    with_sinks = target_features(model, ids, pos, docs, LAYERS)
    for layer in decoder_layers(model):
        layer.self_attn.sinks.data.fill_(-1e4)
    assert (target_features(model, ids, pos, docs, LAYERS) - with_sinks).abs().max() > 1e-3


def test_layers_are_judged_by_their_modules():
    """The linear-attention layers of Qwen3-Next name their mixer; its full-attention layer and
    every layer of the attention-only targets name nothing."""
    model = build("qwen3_next")
    layers, kinds = decoder_layers(model), model.config.layer_types
    found = [mixers(layer, kind) for layer, kind in zip(layers, kinds, strict=True)]
    assert found[1] == found[3] == []
    assert all(any("Qwen3NextGatedDeltaNet" in f for f in found[i]) for i in (0, 2))
    assert any("conv1d (Conv1d)" in f for f in found[0])
    assert unconfined(model, layers, 1)
    for name in ("llama", "qwen3_moe", "gemma3", "gpt_oss"):
        target = build(name)
        assert unconfined(target, decoder_layers(target), 4) == []


class TokenShift(nn.Module):
    """A mixer of a kind nobody told the classifier about: each token adds the previous one."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x + torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1])


def test_an_unknown_module_is_a_mixer():
    assert not pointwise(TokenShift()) and pointwise(nn.Linear(2, 2)) and pointwise(nn.SiLU())
    assert not pointwise(nn.MultiheadAttention(4, 2)) and not pointwise(nn.Conv1d(2, 2, 3))
    layer = nn.ModuleDict({"mix": TokenShift()})
    assert mixers(layer, None) == ["<layer> (ModuleDict)", "mix (TokenShift)"]


def test_document_rows_put_every_feature_back_in_place(monkeypatch):
    """Rows of documents, padding between and after: each slot gets its own document's output."""
    monkeypatch.setattr(document_layout, "LENGTH_STEP", 4)
    docs = torch.tensor([[0, 0, 0, 1, 1, -1, 2, 2, 2, 2, 2, -1], [0] * 5 + [1] * 6 + [-1]])
    ids = torch.arange(docs.numel()).view(docs.shape)
    seen = []

    def run(ids, positions, documents):
        seen.append(documents.clone())
        real = documents >= 0
        assert torch.equal(real, real.cummin(dim=1).values) and (documents[real] == 0).all()
        return torch.stack([ids, positions], dim=-1) * real[..., None]

    got = by_document_rows(run, ids, docs)
    real = docs >= 0
    assert torch.equal(got[..., 0], ids * real)
    starts = DocumentLayout.of(docs).starts
    assert torch.equal(got[..., 1], (torch.arange(12) - starts) * real)
    assert len(seen) == 2  # widths 4 and 8


def test_agreed_calls_change_no_feature():
    """Ranks of a sharded target run as many forwards as the busiest: the extra ones are dropped."""
    ids, pos, docs = packed_row(96)
    calls = []

    def run(ids, positions, documents):
        calls.append(ids.shape)
        return ids[..., None].float() * (documents >= 0)[..., None]

    got = by_document_rows(run, ids, docs, agree=lambda n, device: n + 2)
    assert torch.equal(got, ids[..., None].float()) and calls[:2] == [(1, 1)] * 2
    assert len(calls) == 3  # two extra, then the one length class of 9, 14 and 7 tokens


@pytest.mark.parametrize("name", ["qwen3_next", "gpt_oss"])
def test_a_sharded_target_is_judged_and_exact_alike(name, world_of_one, monkeypatch):
    """FSDP2 renames the layers' classes; the verdict and the features stay, and a hybrid
    target's ranks agree on their forwards even on rows of one document."""
    model = build(name)
    ids, pos, docs = packed_row(model.config.vocab_size)
    want = alone(model, ids)
    shard_target(model, init_device_mesh("cpu", (1,)))
    assert type(decoder_layers(model)[0]).__name__.startswith("FSDP")
    agreed = []
    reduce = dist.all_reduce
    monkeypatch.setattr(
        dist, "all_reduce", lambda t, **kw: agreed.append(int(t)) or reduce(t, **kw)
    )
    got = target_features(model, ids, pos, docs, LAYERS)
    assert (got - want).abs().max() <= 1e-5
    target_features(model, ids[:, :9], pos[:, :9], docs[:, :9], LAYERS)  # one document
    assert agreed == ([1, 1] if TARGETS[name][1] == "rows" else [])
