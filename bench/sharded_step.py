"""One training step on ``world_size`` gloo ranks, DDP or FSDP, and what each rank holds.

``bench/step_memory.py --parallelism fsdp --world-size 2`` runs this: the random target of the
flags is saved once as safetensors, and every rank loads it as training does
(``dflash.model.load``: whole under DDP; under FSDP built on the meta device, sharded, and
only the rank's own rows read), wraps the drafter (``dflash.train.distributed.parallel``), runs one
step
on its own micro-batch and reports its peak RSS, ``target_load_rss_mib`` (the growth of its
peak RSS while loading the target and reading every weight it holds once, so pages of a
memory-mapped file count once touched: host memory a rank needs for it) and ``model_state_mib``:
the bytes of target and drafter parameters, gradients and optimizer state it holds, counted
from its local tensors (the shards of a DTensor, each tensor once).
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from memory_model import MIB, model_state_bytes
from step_memory import GAMMA, dims_of, micro_batch, peak_rss_mib, target_config
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import Qwen3ForCausalLM

from dflash.features.target_forward import target_features
from dflash.model.drafter import DFlashDrafter
from dflash.model.load import load_target, load_target_shards
from dflash.model.objective import dflash_objective
from dflash.train.distributed import parallel
from dflash.train.distributed.process_group import init_distributed


def local_bytes(tensors) -> int:
    """Bytes of the tensors as this rank holds them, each once (tied weights are one)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def local_sum(tensors) -> float:
    """Read every element this rank holds (touches memory-mapped pages as a forward would)."""
    return sum(float((t.to_local() if isinstance(t, DTensor) else t).sum()) for t in tensors)


def held_bytes(target: nn.Module, drafter: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    params = [*target.parameters(), *drafter.parameters()]
    grads = [p.grad for p in drafter.parameters()]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return local_bytes(params) + local_bytes(grads) + local_bytes(state)


def save_random_target(args: argparse.Namespace, directory: Path) -> None:
    """The flags' target, randomly initialised (seeded) and saved as training would read it."""
    torch.manual_seed(0)
    Qwen3ForCausalLM(target_config(args)).save_pretrained(directory)


def load_target_as_training_does(directory: Path, fsdp: bool, ctx) -> nn.Module:
    if not fsdp:
        return load_target(directory, device=ctx.device, dtype=torch.float32)
    device_mesh = parallel.mesh(ctx)
    return load_target_shards(
        directory, ctx.device, torch.float32, lambda t: parallel.shard_target(t, device_mesh)
    )


def rank_step(rank: int, args: argparse.Namespace, directory: Path, port: int, results) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_RANK": str(rank)}
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(args.world_size))
    torch.set_num_threads(1)
    ctx = init_distributed()
    bare = peak_rss_mib()
    fsdp = args.parallelism == "fsdp"
    target = load_target_as_training_does(directory, fsdp, ctx)
    local_sum(target.state_dict().values())
    loaded = peak_rss_mib()
    features_n = args.target_features or min(3, max(1, args.layers - 3))
    drafter = DFlashDrafter.from_target(
        target,
        block_size=args.block_size,
        num_hidden_layers=args.drafter_layers,
        num_target_features=features_n,
        mask_token_id=args.vocab - 1,
    )
    model = parallel.wrap_drafter(drafter, ctx, args.parallelism)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    ids, loss_mask, documents, positions, anchors = micro_batch(args)
    models = peak_rss_mib()
    features = target_features(target, ids, positions, documents, drafter.config.target_layer_ids)
    with parallel.borrowed_unsharded(model):
        out = dflash_objective(
            model, features, ids, loss_mask, documents, positions, anchors, GAMMA
        )
        (out.loss_sum / out.weight_sum).backward()
    parallel.clip_grad_norm(list(drafter.parameters()), 1.0)
    optimizer.step()
    results.put(
        {
            "rank": rank,
            "peak_rss_mib": peak_rss_mib(),
            "models_rss_mib": models,
            "bare_rss_mib": bare,
            "target_load_rss_mib": loaded - bare,
            "model_state_mib": held_bytes(target, drafter, optimizer) / MIB,
            "loss": float(out.loss_sum.detach() / out.weight_sum),
        }
    )
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> dict:
    """Run the step on ``args.world_size`` ranks; the largest rank's figures, and each rank's."""
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as directory:
        # In a process of its own: a child's high-water RSS starts at its parent's.
        saver = context.Process(target=save_random_target, args=(args, Path(directory)))
        saver.start()
        saver.join()
        target_bytes = sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))
        rank_args = (args, Path(directory), free_port(), results)
        mp.start_processes(rank_step, rank_args, nprocs=args.world_size, start_method="spawn")
    ranks = sorted((results.get() for _ in range(args.world_size)), key=lambda r: r["rank"])
    shards = args.world_size if args.parallelism == "fsdp" else 1
    predicted = sum(model_state_bytes(dims_of(args), 4, shards).values()) / MIB
    return {
        "parallelism": args.parallelism,
        "world_size": args.world_size,
        "model_state_mib": round(max(r["model_state_mib"] for r in ranks), 1),
        "predicted_model_state_mib": round(predicted, 1),
        "peak_rss_mib": round(max(r["peak_rss_mib"] for r in ranks), 1),
        "models_rss_mib": round(max(r["models_rss_mib"] for r in ranks), 1),
        "target_load_rss_mib": round(max(r["target_load_rss_mib"] for r in ranks), 1),
        "target_file_mib": round(target_bytes / MIB, 1),
        "per_rank": [{k: round(v, 4) for k, v in r.items()} for r in ranks],
        "vocab": args.vocab,
        "hidden": args.hidden,
        "layers": args.layers,
        "drafter_layers": args.drafter_layers,
        "block_size": args.block_size,
        "tokens_per_rank": args.rows * args.seq_len,
    }
