"""Training-step time per token on the same documents, packed against one document a row.

Needs the pipeline's token store, target and tokenizer (`make repro`). ``--samples`` random
samples are laid out twice, by the ``packed`` strategy (one row a micro-batch) and by
``sorted`` (one document a row, longest first), under the params' budget. Each micro-batch
runs the target's features, the drafter's loss and its backward; the two layouts alternate
``--repeats`` times in one process, so the machine's drift hits both alike. It prints the
median milliseconds per 1,000 real tokens of each part.

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
from dflash.batching.io import Row
from dflash.batching.plan import params_from_config
from dflash.batching.strategies import STRATEGIES
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
LAYOUTS = {"packed": "packed", "one doc a row": "sorted"}
"""The layouts compared, and the strategy that lays each out."""


def micro_batches(strategy: str, ids: np.ndarray, sizes: np.ndarray) -> list[list[Row]]:
    """The micro-batches the ``strategy`` lays these samples out in, as plan rows
    ``(sample_id, offset, length)`` with the store's sample ids."""
    config = load_config(ROOT / "params.yaml", [f"batching.strategy={strategy}"])
    params = params_from_config(config, sizes)
    layout = STRATEGIES[strategy](sizes, params, np.random.default_rng([params.seed, 0]))
    out: list[list[Row]] = []
    offset = 0
    for position, sample in enumerate(layout.order.tolist()):
        if layout.mb_begin[position]:
            out.append([])
        if layout.row_begin[position]:
            out[-1].append([])
            offset = 0
        out[-1][-1].append((int(ids[sample]), offset, int(sizes[sample])))
        offset += int(sizes[sample])
    return out


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
    ids = np.sort(np.random.default_rng(0).choice(len(store), args.samples, replace=False))
    sizes = np.array([len(store[int(i)][0]) for i in ids])
    kwargs = dict(
        block_size=d.block_size, anchors_per_sequence=d.anchors_per_sequence, gamma=d.gamma
    )
    sets = {
        name: [
            build_micro_batch(store, mb, **kwargs, seed=0, epoch=0)
            for mb in micro_batches(strategy, ids, sizes)
        ]
        for name, strategy in LAYOUTS.items()
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
