"""One training step on ``world_size`` gloo ranks, DDP or FSDP, and what each rank holds.

``bench/step_memory.py --parallelism fsdp --world-size 2`` runs this: every rank builds the
random target of the flags on the meta device (so no rank ever allocates it whole), shards or
replicates target and drafter as training does (``dflash.train.parallel``), runs one step on
its own micro-batch and reports its peak RSS and ``model_state_mib``: the bytes of target and
drafter parameters, gradients and optimizer state it holds, counted from its local tensors
(the shards of a DTensor, each tensor once).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from memory_model import MIB, model_state_bytes
from step_memory import GAMMA, dims_of, micro_batch, peak_rss_mib, target_config
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import Qwen3ForCausalLM

from dflash.model.drafter import DFlashDrafter
from dflash.model.features import target_features
from dflash.model.objective import dflash_objective
from dflash.train import parallel
from dflash.train.distributed import init_distributed


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


def held_bytes(target: nn.Module, drafter: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    params = [*target.parameters(), *drafter.parameters()]
    grads = [p.grad for p in drafter.parameters()]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return local_bytes(params) + local_bytes(grads) + local_bytes(state)


def build_target(args: argparse.Namespace, fsdp: bool, ctx) -> Qwen3ForCausalLM:
    """Random target built on the meta device, sharded (or not), then given its storage."""
    config = target_config(args)
    with torch.device("meta"):
        target = Qwen3ForCausalLM(config)
    if fsdp:
        parallel.shard_target(target, parallel.mesh(ctx))
    target.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(std=0.02)
    target.model.rotary_emb = type(target.model.rotary_emb)(config)  # its buffers, recomputed
    return target.eval().requires_grad_(False)


def rank_step(rank: int, args: argparse.Namespace, port: int, results) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_RANK": str(rank)}
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(args.world_size))
    torch.set_num_threads(1)
    ctx = init_distributed()
    bare = peak_rss_mib()
    fsdp = args.parallelism == "fsdp"
    target = build_target(args, fsdp, ctx)
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
    mp.start_processes(
        rank_step, (args, free_port(), results), nprocs=args.world_size, start_method="spawn"
    )
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
        "per_rank": [{k: round(v, 4) for k, v in r.items()} for r in ranks],
        "vocab": args.vocab,
        "hidden": args.hidden,
        "layers": args.layers,
        "drafter_layers": args.drafter_layers,
        "block_size": args.block_size,
        "tokens_per_rank": args.rows * args.seq_len,
    }
