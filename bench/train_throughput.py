"""Train throughput per batching strategy on the tiny default.

``--lengths pipeline`` (default) needs the pipeline's data and target (`make repro`, or
`dvc repro tokenize stats`) and links them into a scratch directory. ``--lengths longtail``
needs nothing: it builds a word-level tokenizer, a random target of the default shape and a
synthetic token store whose lengths follow a chat corpus's long tail scaled to CPU (lognormal,
lengths / 8: mean ~260, clipped to [4 x block_size, ``--max-len``]; loss on second halves),
then runs ``stats`` there. Either way, each strategy is planned for one epoch and trained in
its own scratch directory, ``--runs`` times (strategies interleaved, so load drifts hit all
alike). It prints per strategy the plan's padding efficiency, tokens/s (median, min-max),
and the median against `sorted` and against the best of `sorted` and `bucketed`.
``--families dflash,dflash2`` runs every strategy with each drafter family, interleaved, and
names the rows ``strategy/family``; its ratio column is then against the first row.

    python bench/train_throughput.py [--epochs 1] [--world-size 1] [--strategies a,b]
        [--runs 1] [--families dflash,dflash2] [--set key=value ...]
    python bench/train_throughput.py --lengths longtail --runs 3 [--samples 1200]
        [--max-len 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash.config.params import load_config
from dflash.data.conversations import write_conversations
from dflash.data.store import TokenStoreWriter
from dflash.data.tokenizer import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    MASK_TOKEN,
    PAD_TOKEN,
    tokenizer_hash,
)
from dflash.model.pretrain import build_tiny_target
from dflash.pipeline.workspace import RELATIVE

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ROOT / "params.yaml"
LINKED = [
    "data/tokenized",
    "data/stats",
    "models/target",
    "models/tokenizer",
    "data/ingested/heldout.parquet",
]
"""What a training run reads; the held-out split feeds its simulated τ."""
LONGTAIL_MU, LONGTAIL_SIGMA = 5.2, 0.9
"""The spread of ``bench/plan_bench.py``'s long-tailed lognormal; mu puts the mean after clipping
to [64, 1024] at ~260, that distribution's lengths / 8."""
UNK = "<unk>"


def longtail_lengths(n: int, low: int, high: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(LONGTAIL_MU, LONGTAIL_SIGMA, n), low, high).astype(np.int64)


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with the default vocabulary size: the size is what costs time
    (embedding, logits), and no corpus is needed to build it."""
    special = [PAD_TOKEN, IM_START, IM_END, MASK_TOKEN, UNK]
    words = special + [f"w{i}" for i in range(vocab_size - len(special))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=UNK,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[IM_START],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_store(out: Path, lengths: np.ndarray, tokenizer, max_len: int, seed: int = 0) -> None:
    """Random non-special tokens, loss on the second half of each sample (as a reply is)."""
    rng = np.random.default_rng(seed)
    n_special = len(tokenizer.all_special_ids)
    tokens = rng.integers(n_special, len(tokenizer), int(lengths.sum()))
    mask = np.concatenate([np.arange(n) >= n // 2 for n in lengths]).astype(np.uint8)
    writer = TokenStoreWriter(out)
    writer.extend(
        tokens, mask, lengths, lengths - lengths // 2, [f"s{i}" for i in range(len(lengths))]
    )
    writer.close(
        {
            "source": "bench/train_throughput.py --lengths longtail",
            "tokenizer_hash": tokenizer_hash(tokenizer),
            "vocab_size": len(tokenizer),
            "mask_token_id": tokenizer.mask_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "max_seq_len": max_len,
        }
    )


def write_heldout(path: Path, vocab_size: int, n: int = 8, seed: int = 0) -> None:
    """A few random-word conversations: the held-out batch of train's simulated τ."""
    rng = np.random.default_rng(seed)

    def words() -> str:
        return " ".join(f"w{i}" for i in rng.integers(0, vocab_size - 8, 24))

    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "conversation_id": f"h{i}",
            "messages": [
                {"role": "user", "content": words()},
                {"role": "assistant", "content": words()},
            ],
        }
        for i in range(n)
    ]
    write_conversations(rows, path)


def build_longtail(work: Path, args: argparse.Namespace) -> Path:
    """Write into ``work`` what a training run reads (the ``LINKED`` paths), then ``stats``."""
    config = load_config(PARAMS, shared_sets(args))
    tokenizer = word_tokenizer(config.tokenizer.vocab_size)
    tokenizer.save_pretrained(str(work / RELATIVE.tokenizer))
    target = build_tiny_target(config.target, tokenizer, args.max_len)
    target.save_pretrained(str(work / RELATIVE.target))
    # The shortest sample's second half holds the 2 x block_size loss tokens tokenize requires.
    lengths = longtail_lengths(args.samples, 4 * config.drafter.block_size, args.max_len)
    write_store(work / RELATIVE.tokenized, lengths, tokenizer, args.max_len)
    write_heldout(work / RELATIVE.heldout, config.tokenizer.vocab_size)
    print(
        f"longtail: {len(lengths)} samples, {lengths.sum():,} tokens, mean {lengths.mean():.0f}, "
        f"median {np.median(lengths):.0f}, max {lengths.max()}, "
        f"{(lengths == args.max_len).mean():.1%} at the cap",
        flush=True,
    )
    dflash_cli("stats", shared_sets(args), work)
    return work


def shared_sets(args: argparse.Namespace) -> list[str]:
    """Overrides every stage of every run gets; ``longtail`` raises the length cap."""
    sets = [f"train.epochs={args.epochs}", f"train.world_size={args.world_size}"]
    if args.lengths == "longtail":
        budget = load_config(PARAMS).batching.token_budget
        sets += [
            f"data.max_seq_len={args.max_len}",
            f"batching.token_budget={max(budget, args.max_len)}",
        ]
    return sets + args.set


def dflash_cli(stage: str, sets: list[str], cwd: Path, env: dict | None = None) -> None:
    flags = [x for s in sets for x in ("--set", s)]
    cmd = [sys.executable, "-m", "dflash.cli", stage, "--params", str(PARAMS), *flags]
    subprocess.run(cmd, cwd=cwd, check=True, env=env)


def run_strategy(strategy: str, family: str, args: argparse.Namespace, source: Path) -> dict:
    """Plan and train one strategy and drafter family in a scratch directory linking
    ``source``'s artefacts."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for rel in LINKED:
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).symlink_to(source / rel)
        sets = [
            f"batching.strategy={strategy}",
            f"drafter.family={family}",
            "logging.wandb=disabled",
            f"train.checkpoint_every={10**9}",
            *shared_sets(args),
        ]
        dflash_cli("plan", sets, work)
        threads = str(max(1, os.cpu_count() // args.world_size))
        dflash_cli("train", sets, work, env={**os.environ, "OMP_NUM_THREADS": threads})
        metrics = json.loads((work / RELATIVE.train_details).read_text())
        plan = json.loads((work / RELATIVE.plan_metrics).read_text())
        return {**metrics, "plan_efficiency": plan["padding_efficiency"]}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(m[key] for m in runs)


def print_table(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    """One row per strategy: medians over runs; the ratios compare medians."""
    tps = {s: median_of(runs, "tokens_per_s") for s, runs in results.items()}
    base = tps.get("sorted", next(iter(tps.values())))
    best = max((tps[s] for s in ("sorted", "bucketed") if s in tps), default=None)
    data = "pipeline data" if args.lengths == "pipeline" else f"longtail, {args.samples} samples"
    overrides = f" with {', '.join(args.set)}" if args.set else ""
    print(
        f"\n{data}, world size {args.world_size}, {args.epochs} epoch(s), {args.runs} run(s), "
        f"tiny default params.yaml{overrides}"
    )
    width = max(10, *(len(name) + 1 for name in results))
    header = (
        f"{'strategy':<{width}}{'plan eff':>9}{'tok/s':>9}{'min-max':>15}{'pad tok/s':>11}"
        f"{'vs sorted':>11}{'vs best s/b':>13}{'data wait':>11}{'train s':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, runs in results.items():
        keys = ("plan_efficiency", "padded_tokens_per_s", "data_wait_fraction", "train_seconds")
        med = {k: median_of(runs, k) for k in keys}
        spread = [m["tokens_per_s"] for m in runs]
        vs_best = f"{tps[name] / best:>12.2f}x" if best else f"{'-':>13}"
        print(
            f"{name:<{width}}{med['plan_efficiency']:>9.3f}{tps[name]:>9.0f}"
            f"{f'{min(spread):.0f}-{max(spread):.0f}':>15}{med['padded_tokens_per_s']:>11.0f}"
            f"{tps[name] / base:>10.2f}x{vs_best}"
            f"{med['data_wait_fraction']:>10.1%}{med['train_seconds']:>9.0f}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", choices=["pipeline", "longtail"], default="pipeline")
    parser.add_argument("--samples", type=int, default=1200, help="longtail: samples")
    parser.add_argument("--max-len", type=int, default=1024, help="longtail: longest sample")
    parser.add_argument("--runs", type=int, default=1, help="runs of every strategy")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--strategies", default="sorted,shuffle,bucketed,packed")
    parser.add_argument(
        "--families", default="dflash", help="drafter families, each run with every strategy"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra params override for every run, e.g. drafter.anchors_per_sequence=128",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    strategies = args.strategies.split(",")
    if args.lengths == "pipeline":
        for rel in LINKED:
            if not (ROOT / rel).exists():
                sys.exit(f"{rel} is missing: run `make repro` (or `dvc repro stats`) first")
    families = args.families.split(",")
    arms = {(s if len(families) == 1 else f"{s}/{f}"): (s, f) for s in strategies for f in families}
    results: dict[str, list[dict]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as tmp:
        source = ROOT if args.lengths == "pipeline" else build_longtail(Path(tmp), args)
        for _ in range(args.runs):
            for name, (strategy, family) in arms.items():
                results[name].append(run_strategy(strategy, family, args, source))
    print_table(results, args)


if __name__ == "__main__":
    main()
