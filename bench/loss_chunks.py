"""Time of the chunked loss per chunk size: the labels a chunk holds against its buffer's size.

``ChunkedHeadLoss`` (its forward, which also computes the gradient, and backward) on
``--labels`` random hidden states against a random head of ``--vocab`` x ``--hidden``, in
chunks whose fp32 logits take 8, 16, 32 and 64 MiB, interleaved, ``--repeats`` times. It
prints the labels a chunk, the median and fastest milliseconds, and the median against the
chunk the loss picks on CPU (``chunk_rows``). Two costs pull apart: glibc maps every buffer over
32 MiB afresh, so a big chunk is faulted in page by page at every call, and every chunk reads
the whole head, so few labels a chunk pay that read many times.

    python bench/loss_chunks.py [--labels 3900] [--vocab 4096] [--hidden 128] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash.model.objective import chunk_rows
from dflash.objectives.ce import ChunkedHeadLoss

MIB = (8, 16, 32, 64)


def one_call(rows: int, weight: torch.Tensor, labels: int) -> float:
    """Seconds of one forward and backward with ``rows`` labels a chunk."""
    hidden = torch.randn(labels, weight.shape[1], requires_grad=True)
    target = torch.randint(0, weight.shape[0], (labels,))
    began = time.perf_counter()
    loss, _ = ChunkedHeadLoss.apply(hidden, weight, None, target, torch.rand(labels), rows)
    loss.backward()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labels", type=int, default=3900, help="a packed default micro-batch's")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden) * 0.05
    picked = chunk_rows(args.vocab, weight.device)
    sizes = sorted({max(1, (mib << 20) // (4 * args.vocab)) for mib in MIB} | {picked})
    times: dict[int, list[float]] = {rows: [] for rows in sizes}
    for repeat in range(args.repeats + 2):  # the first two warm up
        for rows in sizes:
            seconds = one_call(rows, weight, args.labels)
            if repeat >= 2:
                times[rows].append(seconds)
    base = statistics.median(times[picked])
    print(
        f"{args.labels} labels x {args.vocab} logits, hidden {args.hidden}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(f"{'labels/chunk':>13}{'MiB':>7}{'ms':>9}{'fastest':>9}{'vs picked':>11}")
    for rows, runs in times.items():
        median = statistics.median(runs)
        mark = "  <- chunk_rows" if rows == picked else ""
        print(
            f"{rows:>13}{rows * args.vocab * 4 / 2**20:>7.1f}{median * 1e3:>9.1f}"
            f"{min(runs) * 1e3:>9.1f}{median / base:>10.2f}x{mark}"
        )


if __name__ == "__main__":
    main()
