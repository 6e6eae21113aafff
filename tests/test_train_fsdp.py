"""FSDP2 training: the same run as DDP up to float rounding, from sharded target and drafter."""

from __future__ import annotations

import csv
import os

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_qwen3
from test_train import final_weights, torchrun

from dflash.model.drafter import DFlashDrafter
from dflash.train.distributed import Dist
from dflash.train.parallel import borrowed_unsharded, clip_grad_norm, wrap_drafter


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of this process alone: FSDP shards over one rank."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def dtypes_seen(ctx: Dist, parallelism: str) -> dict[str, torch.dtype]:
    """Dtypes in the drafter's forward under bf16 autocast (as on CUDA), on a bf16 target."""
    target = tiny_qwen3().to(torch.bfloat16)
    drafter = DFlashDrafter.from_target(
        target, block_size=4, num_hidden_layers=2, num_target_features=2, mask_token_id=1
    )
    model = wrap_drafter(drafter, ctx, parallelism)
    seen = {}

    def record(layer, args):
        x, _, rope_block, rope_context, *_ = args
        i = layer.self_attn.layer
        seen.update(
            {
                f"residual {i}": x.dtype,
                f"rope {i}": rope_block[0].dtype,
                f"rope context {i}": rope_context[0].dtype,
                f"norm weight {i}": layer.input_layernorm.weight.dtype,
                f"projection weight {i}": layer.self_attn.q_proj.weight.dtype,
            }
        )

    for layer in drafter.layers:
        layer.register_forward_pre_hook(record)
    ids = torch.randint(0, 300, (1, 8))
    positions = torch.arange(8)[None]
    features = torch.randn(1, 8, 2 * 32, dtype=torch.bfloat16)
    with borrowed_unsharded(model), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model(ids, positions, features, positions)
    hidden.float().square().mean().backward()
    seen["output"] = hidden.dtype
    seen |= {f"parameter {n}": p.dtype for n, p in drafter.named_parameters()}
    seen |= {f"gradient {n}": p.grad.dtype for n, p in drafter.named_parameters()}
    return seen


def test_fsdp_computes_in_the_dtypes_of_ddp(world_of_one):
    """fp32 parameters, residual stream and RoPE tables, and fp32 gradients, under both."""
    ddp, fsdp = dtypes_seen(world_of_one, "ddp"), dtypes_seen(world_of_one, "fsdp")
    assert fsdp == ddp
    assert ddp["residual 1"] == ddp["rope 0"] == ddp["norm weight 1"] == torch.float32
    assert {d for n, d in ddp.items() if n.startswith(("parameter", "gradient"))} == {torch.float32}


def losses(workspace) -> list[float]:
    return [float(row["loss"]) for row in csv.DictReader(open(workspace / "plots/train/log.csv"))]


@pytest.mark.slow
def test_fsdp_trains_like_ddp(tiny_workspace, tmp_path):
    """2 gloo ranks in fp32: the first 10 steps' losses and the exported drafter agree."""
    runs = {}
    for parallelism in ("ddp", "fsdp"):
        workspace = tmp_path / parallelism
        os.system(f"cp -r {tiny_workspace} {workspace}")
        proc = torchrun(workspace, "train.epochs=1", f"train.parallelism={parallelism}")
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        runs[parallelism] = losses(workspace)[:10], final_weights(workspace)
    (ddp_loss, ddp_weights), (fsdp_loss, fsdp_weights) = runs["ddp"], runs["fsdp"]
    assert len(ddp_loss) == 10
    assert fsdp_loss == pytest.approx(ddp_loss, abs=1e-5)
    assert ddp_weights.keys() == fsdp_weights.keys()
    for name, weight in ddp_weights.items():
        torch.testing.assert_close(fsdp_weights[name], weight, atol=1e-5, rtol=0)


def test_clip_grad_norm_is_torch_clip_grad_norm():
    def params(seed: int) -> list[torch.nn.Parameter]:
        torch.manual_seed(seed)
        out = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
        for p in out:
            p.grad = torch.randn(5) * 3
        return out

    ours, theirs = params(0), params(0)
    norm = clip_grad_norm(ours, 1.0)
    assert norm == torch.nn.utils.clip_grad_norm_(theirs, 1.0).item()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.grad, b.grad)
