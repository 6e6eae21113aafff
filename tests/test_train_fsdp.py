"""FSDP2 training: the same run as DDP up to float rounding, from sharded target and drafter."""

from __future__ import annotations

import pytest
import torch
from conftest import gloo_rank, leave_gloo, spawn_ranks, tiny_qwen3
from run_outputs import final_weights, losses
from safetensors.torch import load_file

from dflash.model.drafter import DFlashDrafter
from dflash.model.load import load_target, load_target_shards, shard_start
from dflash.train.distributed.parallel import (
    borrowed_unsharded,
    clip_grad_norm,
    mesh,
    shard_target,
    wrap_drafter,
)
from dflash.train.distributed.process_group import Dist, from_rank_zero


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


@pytest.mark.slow
def test_fsdp_trains_like_ddp(trained):
    """2 gloo ranks in fp32: the first 10 steps' losses and the exported drafter agree."""
    ddp, fsdp = trained(), trained("train.parallelism=fsdp")
    ddp_loss, fsdp_loss = losses(ddp)[:10], losses(fsdp)[:10]
    assert len(ddp_loss) == 10
    assert fsdp_loss == pytest.approx(ddp_loss, abs=1e-5)
    ddp_weights, fsdp_weights = final_weights(ddp), final_weights(fsdp)
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


def test_shard_start_is_where_torch_chunk_splits():
    for size in (1, 5, 8, 9, 300):
        for world in (1, 2, 3, 4, 8):
            chunks = torch.arange(size).chunk(world)
            starts = [int(c[0]) for c in chunks] + [size] * (world - len(chunks))
            assert [shard_start(size, world, rank) for rank in range(world)] == starts


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, torch.distributed.tensor.DTensor) else tensor


@pytest.mark.parametrize(("tied", "files"), [(False, "one"), (True, "several")])
def test_target_loaded_in_shards_is_the_target(world_of_one, tmp_path, tied, files):
    """Built on the meta device, sharded, then read: every weight, buffer and logit the same."""
    model = tiny_qwen3()
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(
        tmp_path / "target", max_shard_size="100KB" if files == "several" else "5GB"
    )
    assert (len(list((tmp_path / "target").glob("*.safetensors"))) > 1) == (files == "several")
    whole = load_target(tmp_path / "target", "cpu")
    shards = load_target_shards(
        tmp_path / "target",
        torch.device("cpu"),
        torch.float32,
        lambda target: shard_target(target, mesh(world_of_one)),
    )
    assert (shards.lm_head.weight is shards.model.embed_tokens.weight) == tied
    assert whole.state_dict().keys() == shards.state_dict().keys()
    for name, tensor in whole.state_dict().items():
        assert torch.equal(whole_tensor(shards.state_dict()[name]), tensor), name
    for (name, buffer), (other, loaded) in zip(
        whole.named_buffers(), shards.named_buffers(), strict=True
    ):
        assert name == other and torch.equal(buffer, loaded), name
    assert not any(p.requires_grad for p in shards.parameters()) and not shards.training
    ids = torch.randint(0, 300, (2, 12))
    assert torch.equal(shards(ids).logits, whole(ids).logits)


def load_on_two_ranks(rank: int, world_size: int, port: int, results, directory: str) -> None:
    """One of two gloo ranks: a digest from rank 0 alone, and the target in shards."""
    ctx = gloo_rank(rank, world_size, port)
    computed_here = []
    digest = from_rank_zero(ctx, lambda: computed_here.append(rank) or f"rank {rank}'s digest")
    target = load_target_shards(
        directory, ctx.device, torch.float32, lambda t: shard_target(t, mesh(ctx))
    )
    stored = load_file(f"{directory}/model.safetensors")
    state = target.state_dict()
    results.put(
        {
            "rank": rank,
            "digest": digest,
            "computed_here": computed_here,
            "held": sum(p.to_local().numel() for p in target.parameters()),
            "equal": all(torch.equal(whole_tensor(state[n]), t) for n, t in stored.items()),
        }
    )
    leave_gloo()


@pytest.mark.slow
def test_two_ranks_share_rank_zeros_digest_and_each_hold_half_the_target(tmp_path):
    model = tiny_qwen3()
    model.save_pretrained(tmp_path)
    ranks = spawn_ranks(load_on_two_ranks, 2, str(tmp_path))
    assert [r["digest"] for r in ranks] == ["rank 0's digest"] * 2
    assert [r["computed_here"] for r in ranks] == [[0], []]
    assert all(r["equal"] for r in ranks)
    total = sum(p.numel() for p in model.parameters())
    assert sum(r["held"] for r in ranks) == total
    assert max(r["held"] for r in ranks) <= total // 2 + 300 * 32  # a row of each tensor at most
