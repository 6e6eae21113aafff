"""What one DFlash 2 conv keeps for backward, counted by saved-tensor hooks: the conv around a
linear sublayer (``prepare``, the sublayer, ``finish``), its taps recomputed in backward as
``block_convolve`` does, against the same conv keeping each tap's shifted input and kernel.
Prints a Markdown table in units of ``slots x H x 4`` bytes (one fp32 copy of the input), and
the time of a forward and backward of each, as a ratio to the kept one.

    .venv/bin/python bench/conv_memory.py [--hidden 256] [--slots 4096] [--taps 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash.model import dflash2
from dflash.model.dflash2 import GroupedDynamicCausalConv


def kept_bytes(conv: GroupedDynamicCausalConv, u: torch.Tensor, autocast: bool) -> int:
    """Bytes the forward keeps for backward, each storage counted once."""
    storages: dict[tuple[int, torch.dtype], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t

    sublayer = torch.nn.Linear(u.shape[-1], u.shape[-1])
    with (
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        v, dynamic = conv.prepare(u)
        conv.finish(sublayer(v), dynamic)
    return sum(storages.values())


def step_seconds(conv: GroupedDynamicCausalConv, u: torch.Tensor, repeats: int = 5) -> float:
    """The fastest of ``repeats`` forwards and backwards of the conv around a linear sublayer."""
    sublayer = torch.nn.Linear(u.shape[-1], u.shape[-1])
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        v, dynamic = conv.prepare(u)
        conv.finish(sublayer(v), dynamic).square().sum().backward()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--slots", type=int, default=4096)
    parser.add_argument("--taps", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(args.hidden, 16, args.taps, 16)
    with torch.no_grad():
        for p in conv.parameters():
            p.normal_()
    u = torch.randn(1, args.slots, args.hidden, requires_grad=True)
    unit = args.slots * args.hidden * 4
    recompute = dflash2.block_convolve
    print("| taps | recomputed (block_convolve) | kept (every tap's input and kernel) |")
    print("|---|---|---|")
    for name, autocast in (("fp32", False), ("bf16 autocast", True)):
        figures = []
        for convolve in (recompute, dflash2._convolve):
            dflash2.block_convolve = convolve
            figures.append(kept_bytes(conv, u, autocast) / unit)
        dflash2.block_convolve = recompute
        print(f"| {args.taps}, {name} | {figures[0]:.2f}x | {figures[1]:.2f}x |")
    seconds = []
    for convolve in (dflash2._convolve, recompute, dflash2._convolve, recompute):  # interleaved
        dflash2.block_convolve = convolve
        seconds.append(step_seconds(conv, u))
    dflash2.block_convolve = recompute
    ratio = (seconds[1] + seconds[3]) / (seconds[0] + seconds[2])
    print(f"\nforward and backward, fp32: recomputed {ratio:.2f}x the time of kept")


if __name__ == "__main__":
    main()
