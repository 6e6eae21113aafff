"""Training-step time per token on the same documents, packed against one document a row.

Needs the pipeline's token store, target and tokenizer (`make repro`). ``--samples`` random
samples are laid out twice under ``batching.token_budget``: packed (``pack_rows``, one row a
micro-batch, as the ``packed`` strategy does) and one document a row, longest first (as
``sorted`` does). Each micro-batch runs the target's features, the drafter's loss and its
backward; the two layouts alternate ``--repeats`` times in one process, so the machine's drift
hits both alike. It prints the median milliseconds per 1,000 real tokens of each part.

    python bench/step_time.py [--samples 96] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from dflash import paths
from dflash.batching.packing import pack_rows
from dflash.data.store import TokenStore
from dflash.data.tokenizer import load_tokenizer
from dflash.model.drafter import DFlashDrafter
from dflash.model.features import target_features
from dflash.model.load import load_target
from dflash.params import load_config
from dflash.train.batches import MicroBatch, build_micro_batch
from dflash.train.step import drafter_loss

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("features", "drafter", "backward")


def layouts(lengths: dict[int, int], budget: int, seed: int) -> dict[str, list[list[list]]]:
    """Plan rows ``(sample_id, offset, length)`` of both layouts of the same samples."""
    ids = np.array(sorted(lengths))
    sizes = np.array([lengths[i] for i in ids])
    row_of = pack_rows(sizes, budget, np.random.default_rng(seed))
    packed = []
    for r in range(int(row_of.max()) + 1):
        row, offset = [], 0
        for i in np.flatnonzero(row_of == r):
            row.append((int(ids[i]), offset, int(sizes[i])))
            offset += int(sizes[i])
        packed.append([row])
    alone, rows = [], []
    for i in np.argsort(-sizes, kind="stable"):
        if rows and rows[0][0][2] * (len(rows) + 1) > budget:
            alone.append(rows)
            rows = []
        rows.append([(int(ids[i]), 0, int(sizes[i]))])
    return {"packed": packed, "one doc a row": [*alone, rows]}


def timed_step(target, drafter, layer_ids, batches: list[MicroBatch], gamma: float) -> np.ndarray:
    """Seconds of each part over ``batches``."""
    seconds = np.zeros(len(PARTS))
    for mb in batches:
        began = time.perf_counter()
        features = target_features(
            target, mb.input_ids, mb.position_ids, mb.document_ids, layer_ids
        )
        drafted = time.perf_counter()
        out = drafter_loss(drafter, features, mb, gamma)
        lossed = time.perf_counter()
        out.loss_sum.backward()
        seconds += (drafted - began, lossed - drafted, time.perf_counter() - lossed)
    drafter.zero_grad()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="1: as each of 2 ranks has")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = load_config(ROOT / "params.yaml")
    store = TokenStore(ROOT / paths.TOKENIZED)
    tokenizer = load_tokenizer(ROOT / paths.TOKENIZER)
    target = load_target(ROOT / paths.TARGET, device="cpu")  # frozen, as training has it
    d = config.drafter
    drafter = DFlashDrafter.from_target(
        target,
        block_size=d.block_size,
        num_hidden_layers=d.num_hidden_layers,
        num_target_features=d.num_target_features,
        mask_token_id=tokenizer.mask_token_id,
        mask_token=tokenizer.mask_token,
        seed=0,
    )
    layer_ids = drafter.config.target_layer_ids
    picked = np.random.default_rng(0).choice(len(store), args.samples, replace=False)
    lengths = {int(i): len(store[int(i)][0]) for i in picked}
    kwargs = dict(
        block_size=d.block_size, anchors_per_sequence=d.anchors_per_sequence, gamma=d.gamma
    )
    sets = {
        name: [build_micro_batch(store, mb, **kwargs, seed=0, epoch=0) for mb in plan]
        for name, plan in layouts(lengths, config.batching.token_budget, seed=0).items()
    }
    runs: dict[str, list[np.ndarray]] = {name: [] for name in sets}
    for repeat in range(args.repeats + 1):  # the first warms up
        for name, batches in sets.items():
            seconds = timed_step(target, drafter, layer_ids, batches, d.gamma)
            if repeat:
                runs[name].append(seconds)
    print(
        f"{args.samples} samples, {args.threads} thread(s), median of {args.repeats}, "
        "ms per 1,000 real tokens"
    )
    print(
        f"{'layout':<15}{'micro-batches':>14}" + "".join(f"{p:>10}" for p in PARTS) + f"{'step':>8}"
    )
    for name, batches in sets.items():
        per_k = np.array(runs[name]) * 1e6 / sum(mb.real_tokens for mb in batches)
        parts = "".join(f"{statistics.median(per_k[:, i]):>10.1f}" for i in range(len(PARTS)))
        print(f"{name:<15}{len(batches):>14}{parts}{statistics.median(per_k.sum(1)):>8.1f}")


if __name__ == "__main__":
    main()
