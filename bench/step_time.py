"""Training-step time per token of each strategy's micro-batches, interleaved in one process.

``--lengths pipeline`` (default) needs the pipeline's token store, target and tokenizer (`make
repro`); ``--lengths longtail`` builds the synthetic long-tailed workspace of
``bench/train_throughput.py`` instead. The samples (all of the store, or ``--samples`` random
ones of the pipeline's) are laid out by each strategy as its epoch 0 lays them out under
``params.yaml``. Each micro-batch runs the target's features, the drafter's loss and
its backward. The strategies' micro-batches are timed in turn, one of each at a time (the order
flipping every time), for ``--passes`` passes, so the machine's drift hits all alike; each
micro-batch counts its fastest pass. It prints milliseconds per 1,000 real tokens of each part,
and the step against the best of ``sorted`` and ``bucketed``, then the measured cost of one
drafter block slot in target tokens (``batching.slot_cost``).

End-to-end epochs (``bench/train_throughput.py``) add the data loader and the ranks' waits,
and vary by 5-10% from run to run here; this isolates what a strategy's layout costs per token.

    python bench/step_time.py [--samples N] [--strategies sorted,bucketed,packed]
        [--passes 2] [--threads 1]
    python bench/step_time.py --lengths longtail [--samples 1200] [--max-len 1024]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from train_throughput import build_longtail, shared_sets

from dflash.batching.io import Row
from dflash.batching.planner import params_from_config
from dflash.batching.registry import strategy as strategy_named
from dflash.batching.stats_files import BUCKETS
from dflash.config.params import load_config
from dflash.data.store import TokenStore
from dflash.data.tokenizer import load_tokenizer
from dflash.features.target_forward import target_features
from dflash.model.drafter import DFlashDrafter
from dflash.model.load import load_target
from dflash.pipeline.workspace import RELATIVE
from dflash.train.batches import MicroBatch, build_micro_batch
from dflash.train.step import drafter_loss

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("features", "drafter", "backward")
BASELINES = ("sorted", "bucketed")


def micro_batches(
    strategy: str, ids: np.ndarray, sizes: np.ndarray, sets: list[str]
) -> list[list[Row]]:
    """The micro-batches the ``strategy`` lays these samples out in at epoch 0, as plan rows
    ``(sample_id, offset, length)`` with the store's sample ids."""
    config = load_config(ROOT / "params.yaml", [*sets, f"batching.strategy={strategy}"])
    params = params_from_config(config, sizes, RELATIVE.stats / BUCKETS)
    rng = np.random.default_rng([params.seed, 0])
    layout = strategy_named(strategy).layout(sizes, params, rng)
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


def timed_step(target, drafter, layer_ids, mb: MicroBatch, gamma: float) -> np.ndarray:
    """Seconds of each part of one micro-batch's step."""
    began = time.perf_counter()
    features = target_features(target, mb.input_ids, mb.position_ids, mb.document_ids, layer_ids)
    drafted = time.perf_counter()
    out = drafter_loss(drafter, features, mb, gamma)
    lossed = time.perf_counter()
    out.loss_sum.backward()
    seconds = np.array([drafted - began, lossed - drafted, time.perf_counter() - lossed])
    drafter.zero_grad()
    return seconds


def interleaved(run, sets: dict[str, list[MicroBatch]], passes: int) -> dict[str, np.ndarray]:
    """``run(mb)`` on every micro-batch of every set, one of each set at a time: the fastest
    of ``passes`` per micro-batch, ``[micro-batches, parts]`` per set."""
    best = {name: np.full((len(mbs), len(PARTS)), np.inf) for name, mbs in sets.items()}
    names = list(sets)
    for p in range(passes):
        for i in range(max(len(mbs) for mbs in sets.values())):
            for name in names if (i + p) % 2 == 0 else names[::-1]:
                if i < len(sets[name]):
                    seconds = run(sets[name][i])
                    if seconds.sum() < best[name][i].sum():
                        best[name][i] = seconds
    return best


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", choices=["pipeline", "longtail"], default="pipeline")
    parser.add_argument("--samples", type=int, default=None, help="default: all (longtail 1200)")
    parser.add_argument("--max-len", type=int, default=1024, help="longtail: longest sample")
    parser.add_argument("--strategies", default="sorted,bucketed,packed")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="1: as each of 2 ranks has")
    args = parser.parse_args()
    args.epochs, args.world_size, args.set = 1, 1, []  # what ``shared_sets`` reads
    return args


def main() -> None:
    args = parse_args()
    subset = None  # longtail: the whole synthetic store of ``--samples``
    with tempfile.TemporaryDirectory() as tmp:
        if args.lengths == "longtail":
            args.samples = args.samples or 1200  # what ``build_longtail`` writes
            os.chdir(build_longtail(Path(tmp), args))
        else:
            subset = args.samples
            os.chdir(ROOT)  # the params' relative paths (bucket edges from `stats`)
        compare(args, shared_sets(args), subset)


def compare(args: argparse.Namespace, sets: list[str], subset: int | None) -> None:
    """Time every strategy's micro-batches of the workspace in the working directory, over
    ``subset`` random samples (None: all)."""
    torch.set_num_threads(args.threads)
    config = load_config(ROOT / "params.yaml", sets)
    store = TokenStore(RELATIVE.tokenized)
    tokenizer = load_tokenizer(RELATIVE.tokenizer)
    target = load_target(RELATIVE.target, device="cpu")  # frozen, as training has it
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
    ids = np.arange(len(store))
    if subset is not None:
        ids = np.sort(np.random.default_rng(0).choice(len(store), subset, replace=False))
    sizes = np.array([len(store[int(i)][0]) for i in ids])
    kwargs = dict(
        block_size=d.block_size, anchors_per_sequence=d.anchors_per_sequence, gamma=d.gamma
    )
    batches = {
        strategy: [
            build_micro_batch(store, mb, **kwargs, seed=0, epoch=0)
            for mb in micro_batches(strategy, ids, sizes, sets)
        ]
        for strategy in args.strategies.split(",")
    }
    best = interleaved(
        lambda mb: timed_step(target, drafter, layer_ids, mb, d.gamma), batches, args.passes
    )
    print(
        f"{args.lengths}: {len(ids)} samples, {args.threads} thread(s), fastest of "
        f"{args.passes} passes per micro-batch, ms per 1,000 real tokens"
    )
    print_table(batches, best)
    print_slot_cost(batches, best, d.block_size)


def print_slot_cost(
    batches: dict[str, list[MicroBatch]], best: dict[str, np.ndarray], block_size: int
) -> None:
    """One drafter block slot's time (forward and backward) in target tokens' feature time:
    the ``batching.slot_cost`` that deals these shapes' ranks equal work."""
    for name, mbs in batches.items():
        seconds = best[name].sum(0)
        slots = block_size * sum(int((mb.anchors >= 0).sum()) for mb in mbs)
        tokens = sum(mb.padded_tokens for mb in mbs)
        ratio = (seconds[1] + seconds[2]) / slots / (seconds[0] / tokens)
        print(f"{name}: slot cost {ratio:.3f} target tokens ({slots:,} slots, {tokens:,} tokens)")


def print_table(batches: dict[str, list[MicroBatch]], best: dict[str, np.ndarray]) -> None:
    print(
        f"{'strategy':<10}{'micro-batches':>14}"
        + "".join(f"{p:>10}" for p in PARTS)
        + f"{'step':>8}{'vs best s/b':>13}"
    )
    per_k = {
        name: best[name].sum(0) * 1e6 / sum(mb.real_tokens for mb in mbs)
        for name, mbs in batches.items()
    }
    baseline = min((per_k[b].sum() for b in BASELINES if b in per_k), default=None)
    for name, parts in per_k.items():
        ratio = f"{baseline / parts.sum():>12.3f}x" if baseline else ""
        cells = "".join(f"{v:>10.1f}" for v in parts)
        print(f"{name:<10}{len(batches[name]):>14}{cells}{parts.sum():>8.1f}{ratio}")


if __name__ == "__main__":
    main()
