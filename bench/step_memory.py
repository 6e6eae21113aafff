"""Peak memory and time of one full DFlash training step at real shapes, on random models.

``python bench/step_memory.py --vocab 151936 --hidden 256 --layers 4 --seq-len 8192 --rows 1
--anchors 512 --block-size 16 --json`` builds a random Qwen3-shaped target and a drafter from
the flags alone (no files), runs one training step on one micro-batch (target features, drafter
forward, loss, backward, AdamW step) and prints one JSON line. Peak RSS is the whole process's
high-water mark, so run one shape per process: ``--table`` does that for a grid of sequence
lengths and anchor counts and prints a Markdown table. ``--parallelism {ddp,fsdp}
--world-size 2`` runs the step on 2 gloo ranks instead and adds what each rank holds
(``bench/sharded_step.py``). ``--family dflash2`` measures a DFlash 2 drafter: its
convolutions, and its selector's codebooks over the whole vocabulary at ``--selector-rank``.
``--steps 2`` measures a second step, which holds AdamW's moments through its backward as
training does (the first step's backward runs before they exist).
``--topology decoupled`` runs a target rank's part (the target and its features) and a
drafter rank's part (the borrowed embedding and head, the drafter's step on received
features) in a process each and prints the memory of each role.

What carries over to a GPU is the growth, not the seconds: a shape whose step does not fit in
CPU memory holds the same tensors on a GPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np
import torch
from memory_model import MIB, Batch, Dims, dflash2_sizes, role_components, step_bytes
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.features.target_forward import target_features
from dflash.model.anchors import sample_anchors
from dflash.model.dflash2_drafter import DFlash2Drafter
from dflash.model.drafter import DFlashDrafter
from dflash.model.objective import dflash_objective

GAMMA = 7.0
HEAD_DIM = 64


def peak_rss_mib() -> float:
    """High-water resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def target_config(args: argparse.Namespace) -> Qwen3Config:
    heads = max(1, args.hidden // HEAD_DIM)
    return Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=args.hidden // heads,
        intermediate_size=3 * args.hidden,
        max_position_embeddings=max(args.seq_len, 4096),
    )


def feature_count(args: argparse.Namespace) -> int:
    return args.target_features or min(3, max(1, args.layers - 3))


def dims_of(args: argparse.Namespace) -> Dims:
    """The memory model's sizes of the flags' target and drafter."""
    c = target_config(args)
    return Dims(
        vocab=args.vocab,
        hidden=args.hidden,
        target_layers=args.layers,
        intermediate=c.intermediate_size,
        heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        drafter_layers=args.drafter_layers,
        features=feature_count(args),
        block_size=args.block_size,
    )


def borrowed_target(config: Qwen3Config) -> Qwen3ForCausalLM:
    """What a decoupled drafter rank holds of the target: embedding and head, the rest meta."""
    with torch.device("meta"):
        target = Qwen3ForCausalLM(config)
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    target.set_input_embeddings(embed)
    target.set_output_embeddings(head)
    return target.eval().requires_grad_(False)


def build_models(args: argparse.Namespace) -> tuple[Qwen3ForCausalLM, DFlashDrafter]:
    """A random target and, ``--family dflash2``, a DFlash 2 drafter with its selector over the
    whole vocabulary (its objective then adds the selector's term)."""
    torch.manual_seed(0)
    config = target_config(args)
    if args.role == "drafter":
        target = borrowed_target(config)
    else:
        target = Qwen3ForCausalLM(config).eval().requires_grad_(False)
    options = {
        "block_size": args.block_size,
        "num_hidden_layers": args.drafter_layers,
        "num_target_features": feature_count(args),
        "mask_token_id": args.vocab - 1,
    }
    if args.family == "dflash2":
        return target, DFlash2Drafter.from_target(target, sizes=dflash2_sizes(args), **options)
    return target, DFlashDrafter.from_target(target, **options)


def micro_batch(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """``rows`` rows of one ``seq_len``-token document each; anchors drawn as in training."""
    rng = np.random.default_rng(0)
    shape = (args.rows, args.seq_len)
    ids = torch.as_tensor(rng.integers(0, args.vocab - 1, size=shape))
    loss_mask = torch.ones(shape, dtype=torch.long)
    documents = torch.zeros(shape, dtype=torch.long)
    positions = torch.arange(args.seq_len).repeat(args.rows, 1)
    anchors = torch.as_tensor(
        np.stack(
            [
                sample_anchors(np.ones(args.seq_len), args.block_size, args.anchors, rng)
                for _ in range(args.rows)
            ]
        )
    )
    return ids, loss_mask, documents, positions, anchors


def limit_memory(gib: float | None) -> None:
    """Cap the address space, so a shape that cannot fit fails alone instead of the machine."""
    if gib:
        limit = int(gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def predicted_mib(args: argparse.Namespace) -> float:
    """The memory model's figure for this step in fp32, on top of the bare process."""
    batch = Batch(rows=args.rows, row_len=args.seq_len, anchors=args.anchors)
    if args.role != "both":
        parts = role_components(dims_of(args), batch, 4, 4, args.role, dflash2=dflash2_sizes(args))
        return sum(parts.values()) / MIB
    return step_bytes(dims_of(args), batch, 4, 4, dflash2=dflash2_sizes(args)) / MIB


def one_step(args: argparse.Namespace) -> dict:
    bare = peak_rss_mib()
    target, drafter = build_models(args)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    ids, loss_mask, documents, positions, anchors = micro_batch(args)
    layers = drafter.config.target_layer_ids
    rss_models = peak_rss_mib()
    start = time.perf_counter()
    if args.role == "drafter":  # as received from a target rank
        width = len(layers) * args.hidden
        features = torch.randn(args.rows, args.seq_len, width)
    else:
        features = target_features(target, ids, positions, documents, layers)
    if args.role == "target":
        return role_result(args, bare, rss_models, time.perf_counter() - start)
    steps = getattr(args, "steps", 1)
    for _ in range(steps):  # features once: the target is frozen
        out = dflash_objective(
            drafter, features, ids, loss_mask, documents, positions, anchors, GAMMA
        )
        (out.loss_sum / out.weight_sum).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    step_s = (time.perf_counter() - start) / steps
    return {
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "models_rss_mib": round(rss_models, 1),
        "predicted_peak_rss_mib": round(bare + predicted_mib(args), 1),
        "bare_rss_mib": round(bare, 1),
        "step_s": round(step_s, 3),
        "tokens": args.rows * args.seq_len,
        "anchors": int((anchors >= 0).sum()),
        "labels": int(out.counted.sum()),
        "vocab": args.vocab,
        "hidden": args.hidden,
        "layers": args.layers,
        "block_size": args.block_size,
        "family": args.family,
        "steps": steps,
        "loss": round(float(out.loss_sum.detach() / out.weight_sum), 4),
    }


def role_result(args: argparse.Namespace, bare: float, rss_models: float, seconds: float):
    return {
        "role": args.role,
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "models_rss_mib": round(rss_models, 1),
        "predicted_peak_rss_mib": round(bare + predicted_mib(args), 1),
        "step_s": round(seconds, 3),
        "tokens": args.rows * args.seq_len,
    }


def per_role(args: argparse.Namespace) -> None:
    """A target rank's and a drafter rank's part of the step, each in its own process."""
    flags = [*sys.argv[1:], "--topology=colocated"]  # the last one counts
    print("| role | peak RSS (MiB) | model (MiB) | models alone (MiB) | step (s) |")
    print("|---|---|---|---|---|")
    for role in ("target", "drafter"):
        run = subprocess.run(
            [sys.executable, __file__, *flags, f"--role={role}", "--json"],
            capture_output=True,
            text=True,
            check=True,
        )
        r = json.loads(run.stdout.strip().splitlines()[-1])
        print(
            f"| {role} | {r['peak_rss_mib']:,.0f} | {r['predicted_peak_rss_mib']:,.0f} | "
            f"{r['models_rss_mib']:,.0f} | {r['step_s']:.2f} |"
        )


def table(args: argparse.Namespace) -> None:
    """One fresh process per shape, so each peak is that shape's own."""
    print("| seq-len | anchors | peak RSS (MiB) | model (MiB) | models alone (MiB) | step (s) |")
    print("|---|---|---|---|---|---|")
    for seq_len in (2048, 4096, 8192):
        for anchors in (128, 512):
            flags = [
                f"--vocab={args.vocab}",
                f"--hidden={args.hidden}",
                f"--layers={args.layers}",
                f"--seq-len={seq_len}",
                f"--rows={args.rows}",
                f"--anchors={anchors}",
                f"--block-size={args.block_size}",
                f"--family={args.family}",
                f"--selector-rank={args.selector_rank}",
                f"--top-k={args.top_k}",
                f"--steps={args.steps}",
                f"--max-gib={args.max_gib or 0}",
                "--json",
            ]
            run = subprocess.run(
                [sys.executable, __file__, *flags], capture_output=True, text=True, check=False
            )
            if run.returncode:
                why = "out of memory" if "alloc" in run.stderr.lower() else "failed"
                print(f"| {seq_len:,} | {anchors} | > {args.max_gib} GiB: {why} | | | |")
                continue
            r = json.loads(run.stdout.strip().splitlines()[-1])
            print(
                f"| {seq_len:,} | {anchors} | {r['peak_rss_mib']:,.0f} | "
                f"{r['predicted_peak_rss_mib']:,.0f} | {r['models_rss_mib']:,.0f} | "
                f"{r['step_s']:.2f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--drafter-layers", type=int, default=1)
    parser.add_argument("--target-features", type=int, default=None)
    parser.add_argument("--max-gib", type=float, default=None, help="address-space cap")
    parser.add_argument("--parallelism", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--world-size", type=int, default=1, help="gloo ranks")
    parser.add_argument("--topology", choices=["colocated", "decoupled"], default="colocated")
    parser.add_argument("--role", choices=["both", "target", "drafter"], default="both")
    parser.add_argument("--family", choices=["dflash", "dflash2"], default="dflash")
    parser.add_argument("--selector-rank", type=int, default=256, help="dflash2 (z-lab's 256)")
    parser.add_argument("--top-k", type=int, default=16, help="dflash2: selector_top_k")
    parser.add_argument("--steps", type=int, default=1, help="training steps on the batch")
    parser.add_argument("--json", action="store_true", help="one JSON line instead of text")
    parser.add_argument("--table", action="store_true", help="seq-len x anchors grid, Markdown")
    args = parser.parse_args()
    if args.table:
        table(args)
        return
    if args.topology == "decoupled":
        per_role(args)
        return
    limit_memory(args.max_gib)
    if args.world_size > 1:
        from sharded_step import run  # noqa: PLC0415 - it imports this module's helpers

        result = run(args)
    else:
        result = one_step(args)
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
