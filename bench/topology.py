"""How many GPUs should run the target and how many train the drafter (``train.topology``).

``python bench/topology.py --workspace .`` times, on the run's own target and plan shapes (the
first micro-batches of epoch 0, rank 0), the target's features and the drafter's step (forward,
backward, AdamW) per real token, and prints the split of ``--gpus`` that balances them. Without
``--workspace`` it uses the FLOP model of ``bench/memory_model.py`` for the recipe targets of
``bench/gpu_memory.py``; ``--target-efficiency`` is the target's achieved FLOP rate over the
drafter's (inference prefill usually runs nearer peak than training).

A decoupled run is as fast as its slower side: ``n`` target ranks give ``n / t_target`` tokens
per second, ``gpus - n`` drafter ranks ``(gpus - n) / t_drafter``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from gpu_memory import GPUS, TARGETS
from memory_model import Batch, drafter_flops_per_token, target_flops_per_token

from dflash.batching.io import epoch_path, read_rank_plan
from dflash.config.params import load_config
from dflash.data.store import TokenStore
from dflash.features.target_forward import target_features
from dflash.model.drafter import DFlashDrafter
from dflash.model.load import load_target
from dflash.pipeline.workspace import RELATIVE
from dflash.train.batches import build_micro_batch
from dflash.train.step import drafter_loss


def best_split(gpus: int, t_target: float, t_drafter: float) -> tuple[int, float]:
    """Target GPUs that maximise ``min(n / t_target, (gpus - n) / t_drafter)``, and that rate
    relative to all ``gpus`` colocated (each paying ``t_target + t_drafter`` per token)."""
    rates = {n: min(n / t_target, (gpus - n) / t_drafter) for n in range(1, gpus)}
    n = max(rates, key=rates.get)
    return n, rates[n] / (gpus / (t_target + t_drafter))


def measure(workspace: Path, micro_batches: int) -> tuple[float, float, int]:
    """Seconds per real token of the target's features and of the drafter's step."""
    os.chdir(workspace)
    config = load_config("params.yaml")
    d = config.drafter
    target = load_target(RELATIVE.target, device="cpu")
    drafter = DFlashDrafter.from_target(
        target,
        block_size=d.block_size,
        num_hidden_layers=d.num_hidden_layers,
        num_target_features=d.num_target_features,
        mask_token_id=target.config.vocab_size - 1,
    )
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    layers = drafter.config.target_layer_ids
    store = TokenStore(RELATIVE.tokenized)
    steps = read_rank_plan(epoch_path(RELATIVE.plans, 0), 0)
    rows = [mb for step in steps for mb in step][:micro_batches]
    kwargs = dict(
        block_size=d.block_size,
        anchors_per_sequence=d.anchors_per_sequence,
        gamma=d.gamma,
        seed=0,
        epoch=0,
    )
    t_target = t_drafter = 0.0
    tokens = 0
    for r in rows:
        mb = build_micro_batch(store, r, **kwargs)
        began = time.perf_counter()
        features = target_features(target, mb.input_ids, mb.position_ids, mb.document_ids, layers)
        middle = time.perf_counter()
        out = drafter_loss(drafter, features, mb, d.gamma)
        (out.loss_sum / max(out.weight_sum, 1e-12)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t_target += middle - began
        t_drafter += time.perf_counter() - middle
        tokens += mb.real_tokens
    return t_target / tokens, t_drafter / tokens, tokens


def modelled(args: argparse.Namespace) -> None:
    print(
        f"FLOP model, rows of {args.row_len:,} tokens, {args.anchors} anchors per row, "
        f"target efficiency {args.target_efficiency:g} x the drafter's\n"
    )
    print(
        "| target | GFLOP/token target | GFLOP/token drafter | GPUs | target : drafter | "
        "vs colocated |"
    )
    print("|---|---|---|---|---|---|")
    batch = Batch(rows=1, row_len=args.row_len, anchors=args.anchors)
    for name, dims in TARGETS.items():
        t = target_flops_per_token(dims, args.row_len)
        dr = drafter_flops_per_token(dims, batch)
        n, gain = best_split(args.gpus, t / args.target_efficiency, dr)
        print(
            f"| {name} | {t / 1e9:.1f} | {dr / 1e9:.1f} | {args.gpus} | "
            f"{n} : {args.gpus - n} | {gain:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", type=Path, default=None)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=GPUS)
    parser.add_argument("--row-len", type=int, default=4096)
    parser.add_argument("--anchors", type=int, default=1024, help="anchors per row")
    parser.add_argument("--target-efficiency", type=float, default=1.0)
    args = parser.parse_args()
    if args.workspace is None:
        modelled(args)
        return
    torch.set_num_threads(1)
    t_target, t_drafter, tokens = measure(args.workspace, args.micro_batches)
    n, gain = best_split(args.gpus, t_target, t_drafter)
    print(
        f"measured on {tokens:,} tokens: target {t_target * 1e6:.1f} us/token, drafter "
        f"{t_drafter * 1e6:.1f} us/token (drafter / target = {t_drafter / t_target:.2f})"
    )
    print(
        f"{args.gpus} ranks: train.target_ranks = {n}, train.world_size = {args.gpus - n} "
        f"({gain:.2f}x the tokens/s of {args.gpus} colocated ranks)"
    )


if __name__ == "__main__":
    main()
