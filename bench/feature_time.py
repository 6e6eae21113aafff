"""Target-feature time per token: packed rows against one-document rows, as documents per row grow.

A random target of the default shape (``params.yaml``'s ``target``; the weights do not change the
time) computes the features of the same documents twice: packed ``k`` to a row of ``--seq-len``
tokens, and one document to a row (rows as wide as the longest document). It prints the median
milliseconds per 1,000 real tokens of each over ``--repeats`` runs, and packed against its own
``k = 1`` value: the aim is a flat line (at most 1.2x) from 1 to 16 documents per row.

With ``--hybrid``, the target is a Qwen3-Next of the same shape (three gated delta-net layers to
one of full attention): its packed rows take the exact path, one document per row, and the
table adds the time the packed fast path would take on the same rows (``fast``: wrong features
on such a target, shown only for what exactness costs).

    python bench/feature_time.py [--rows 4] [--seq-len 512] [--docs 1,4,16] [--repeats 7]
        [--sliding-window W | --hybrid]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
import yaml
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

from dflash.features import target_forward as features
from dflash.features.target_forward import target_features
from dflash.model.layer_ids import target_layer_ids

ROOT = Path(__file__).resolve().parents[1]


def default_shape() -> dict:
    """The default target's sizes from ``params.yaml``, as config keywords."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    t = params["target"]
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    return {k: t[k] for k in (*keys, "num_key_value_heads")} | {
        "vocab_size": params["tokenizer"]["vocab_size"]
    }


def default_target(window: int | None) -> Qwen3ForCausalLM:
    """A random Qwen3 of the default target's shape; with ``window``, every other layer slides."""
    shape = default_shape()
    layers = shape["num_hidden_layers"]
    extra = {}
    if window is not None:
        kinds = (["sliding_attention", "full_attention"] * layers)[:layers]
        extra = {"use_sliding_window": True, "sliding_window": window, "layer_types": kinds}
    torch.manual_seed(0)
    config = Qwen3Config(**shape, **extra)
    return Qwen3ForCausalLM(config).eval()


def hybrid_target() -> Qwen3NextForCausalLM:
    """A random Qwen3-Next of the default target's shape: gated delta-net layers, every fourth
    one full attention, dense MLPs."""
    shape = default_shape()
    layers, head = shape["num_hidden_layers"], shape["hidden_size"] // shape["num_attention_heads"]
    torch.manual_seed(0)
    config = Qwen3NextConfig(
        **shape,
        head_dim=head,
        layer_types=[("full" if i % 4 == 3 else "linear") + "_attention" for i in range(layers)],
        linear_num_key_heads=shape["num_key_value_heads"],
        linear_num_value_heads=shape["num_attention_heads"],
        linear_key_head_dim=head,
        linear_value_head_dim=head,
        mlp_only_layers=list(range(layers)),
    )
    return Qwen3NextForCausalLM(config).eval()


@contextlib.contextmanager
def fast_path_forced():
    """Packed rows through document attention whatever the target mixes: timing only."""
    judge = features.unconfined
    features.unconfined = lambda *args: []
    try:
        yield
    finally:
        features.unconfined = judge


def documents(rows: int, seq_len: int, per_row: int, gen: torch.Generator) -> list[list[int]]:
    """Per row, ``per_row`` document lengths filling ``seq_len`` (random cuts, at least 8 each)."""
    out = []
    for _ in range(rows):
        cuts = torch.randperm(seq_len // 8 - 1, generator=gen)[: per_row - 1].add(1).mul(8)
        bounds = [0, *sorted(cuts.tolist()), seq_len]
        out.append([b - a for a, b in zip(bounds, bounds[1:], strict=False)])
    return out


def micro_batch(rows: list[list[int]], vocab: int, gen: torch.Generator):
    """``input_ids, position_ids, document_ids`` of rows holding documents of these lengths."""
    width = max(sum(row) for row in rows)
    ids = torch.randint(0, vocab, (len(rows), width), generator=gen)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    docs = torch.full((len(rows), width), -1)
    for r, row in enumerate(rows):
        start = 0
        for d, n in enumerate(row):
            pos[r, start : start + n] = torch.arange(n)
            docs[r, start : start + n] = d
            start += n
    return ids, pos, docs


def ms_per_kilotoken(target, batch, layer_ids: list[int], repeats: int) -> float:
    """Median over ``repeats`` runs (after one warm-up) of the feature time per 1,000 tokens."""
    tokens = int((batch[2] >= 0).sum())
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        target_features(target, *batch, layer_ids)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6 / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--docs", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=7)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--sliding-window", type=int, default=None)
    kind.add_argument("--hybrid", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = hybrid_target() if args.hybrid else default_target(args.sliding_window)
    layer_ids = target_layer_ids(target.config.num_hidden_layers, 3)
    gen = torch.Generator().manual_seed(0)
    print(f"ms per 1,000 tokens, {args.rows} rows of {args.seq_len}, median of {args.repeats}")
    print(f"{'docs/row':>8}{'packed':>9}{'one-doc':>9}{'vs k=1':>8}" + f"{'fast':>8}" * args.hybrid)
    first = None
    for k in (int(x) for x in args.docs.split(",")):
        rows = documents(args.rows, args.seq_len, k, gen)
        packed = micro_batch(rows, target.config.vocab_size, gen)
        alone = micro_batch([[n] for row in rows for n in row], target.config.vocab_size, gen)
        p = ms_per_kilotoken(target, packed, layer_ids, args.repeats)
        a = ms_per_kilotoken(target, alone, layer_ids, args.repeats)
        first = first or p
        line = f"{k:>8}{p:>9.2f}{a:>9.2f}{p / first:>7.2f}x"
        if args.hybrid:
            with fast_path_forced():
                line += f"{ms_per_kilotoken(target, packed, layer_ids, args.repeats):>8.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
