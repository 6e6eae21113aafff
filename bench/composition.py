"""Batch composition: does a strategy make the step loss follow the step's sample lengths?

Self-contained, like ``bench/train_throughput.py --lengths longtail``: a word-level tokenizer,
a random target of the default shape, and a synthetic token store of long-tailed lengths
(lognormal, clipped to [4 x block_size, ``--max-len``]) whose content depends on the length:
a sample draws its tokens from a vocabulary that grows with its length, so long samples are
harder to predict than short ones, as long chats are harder than greetings. Each strategy
trains ``--epochs`` on the same store; per strategy it prints ``loss_length_corr`` (Spearman
of step loss against step mean sample length), how far apart the steps' mean lengths are,
the loss spikes, the grad-norm CV and the final loss, each the median over ``--runs``.

    python bench/composition.py [--samples 800] [--max-len 512] [--epochs 1] [--runs 1]
        [--token-budget 2048] [--strategies sorted,shuffle,bucketed,packed]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
from train_throughput import (
    PARAMS,
    dflash_cli,
    longtail_lengths,
    word_tokenizer,
    write_heldout,
)

from dflash.config.params import load_config
from dflash.data.store import TokenStoreWriter
from dflash.data.tokenizer import tokenizer_hash
from dflash.model.pretrain import build_tiny_target
from dflash.pipeline.workspace import RELATIVE

SMALLEST_VOCAB, LARGEST_VOCAB = 2, 256
"""Distinct tokens of the shortest and of the longest samples: small enough that a drafter
learns the ids' frequencies within a pilot, so the loss follows the length from the start."""
FIGURES = ("loss_length_corr", "length_cv", "loss_spikes", "grad_norm_cv", "final_loss")
"""``length_cv``: the coefficient of variation of the steps' mean sample lengths, how far
apart the steps' lengths are (``plots/train/steps.csv``)."""


def mixed_tokens(lengths: np.ndarray, first: int, seed: int = 0) -> np.ndarray:
    """Each sample's tokens drawn from ids ``first`` to ``first + k``, k growing geometrically
    with its length."""
    rng = np.random.default_rng(seed)
    share = (lengths - lengths.min()) / max(lengths.max() - lengths.min(), 1)
    sizes = np.rint(SMALLEST_VOCAB * (LARGEST_VOCAB / SMALLEST_VOCAB) ** share).astype(int)
    return np.concatenate(
        [first + rng.integers(0, k, n) for n, k in zip(lengths, sizes, strict=True)]
    )


def build(work: Path, args: argparse.Namespace) -> list[str]:
    """The store, target, tokenizer and held-out split in ``work``, then ``stats``; the sets
    every run gets."""
    sets = [
        f"data.max_seq_len={args.max_len}",
        f"batching.token_budget={max(args.token_budget, args.max_len)}",
        f"train.epochs={args.epochs}",
        "train.world_size=1",
        "logging.wandb=disabled",
        "logging.every=1",
        f"train.checkpoint_every={10**9}",
    ]
    config = load_config(PARAMS, sets)
    tokenizer = word_tokenizer(config.tokenizer.vocab_size)
    tokenizer.save_pretrained(str(work / RELATIVE.tokenizer))
    build_tiny_target(config.target, tokenizer, args.max_len).save_pretrained(
        str(work / RELATIVE.target)
    )
    lengths = longtail_lengths(args.samples, 4 * config.drafter.block_size, args.max_len)
    first = len(tokenizer.all_special_ids)
    tokens = mixed_tokens(lengths, first)
    mask = np.concatenate([np.arange(n) >= n // 2 for n in lengths]).astype(np.uint8)
    writer = TokenStoreWriter(work / RELATIVE.tokenized)
    writer.extend(
        tokens, mask, lengths, lengths - lengths // 2, [f"s{i}" for i in range(len(lengths))]
    )
    writer.close({
        "source": "bench/composition.py", "tokenizer_hash": tokenizer_hash(tokenizer),
        "vocab_size": len(tokenizer), "mask_token_id": tokenizer.mask_token_id,
        "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
        "max_seq_len": args.max_len,
    })  # fmt: skip
    write_heldout(work / RELATIVE.heldout, config.tokenizer.vocab_size)
    print(
        f"{len(lengths)} samples, mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, "
        f"max {lengths.max()} tokens; vocabulary {SMALLEST_VOCAB} to {LARGEST_VOCAB} ids",
        flush=True,
    )
    dflash_cli("stats", sets, work)
    return sets


def train(strategy: str, sets: list[str], source: Path) -> dict:
    """Plan and train one strategy in a scratch directory linking ``source``'s inputs."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for rel in (
            RELATIVE.tokenized,
            RELATIVE.stats,
            RELATIVE.target,
            RELATIVE.tokenizer,
            RELATIVE.heldout,
        ):
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).symlink_to(source / rel)
        run_sets = [*sets, f"batching.strategy={strategy}"]
        dflash_cli("plan", run_sets, work)
        dflash_cli("train", run_sets, work)
        lengths = [
            float(r["mean_sample_length"])
            for r in csv.DictReader(open(work / RELATIVE.train_steps))
        ]
        spread = {"length_cv": float(np.std(lengths) / np.mean(lengths))}
        return json.loads((work / RELATIVE.train_details).read_text()) | spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=800)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--token-budget", type=int, default=2048, help="tokens per micro-batch")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--strategies", default="sorted,shuffle,bucketed,packed")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    results: dict[str, list[dict]] = {s: [] for s in strategies}
    with tempfile.TemporaryDirectory() as tmp:
        sets = build(Path(tmp), args)
        for _ in range(args.runs):
            for strategy in strategies:
                results[strategy].append(train(strategy, sets, Path(tmp)))
    print(f"\n{'strategy':<10}" + "".join(f"{f:>20}" for f in FIGURES))
    for strategy, runs in results.items():
        cells = []
        for figure in FIGURES:
            values = [r[figure] for r in runs if r.get(figure) is not None]
            cells.append(f"{statistics.median(values):>20.3f}" if values else f"{'n/a':>20}")
        print(f"{strategy:<10}" + "".join(cells))


if __name__ == "__main__":
    main()
