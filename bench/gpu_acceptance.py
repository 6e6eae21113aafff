"""The first command on a new GPU machine: do the kernels, the pipeline and resume hold there?

    python bench/gpu_acceptance.py           # one H100/H200, a few minutes
    python bench/gpu_acceptance.py --smoke   # the same checks at tiny shapes, on CPU too

Prints one JSON line per check, ``{"check", "value", "threshold", "pass"}``, and exits 1 if any
check fails. The kernel checks run in this process; the pipeline checks build a small workspace
in a temporary directory and train it under ``torchrun --nproc_per_node 1``: DDP with
checkpoints, FSDP against DDP, SIGKILL and resume, then ``evaluate``. Twelve steps of varied
shapes count host reads per micro-batch and report memory and MFU on the device. ``make test`` runs
``--smoke``, so the script cannot rot on machines without a GPU; it reports times there and
gates none. ``--engine-url URL
--engine-target DIR`` also compares a vLLM ``extract_hidden_states`` server's features with
colocated ones (docs/engines.md).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DATA_STAGES = ["ingest", "tokenizer", "target", "regenerate", "tokenize", "stats", "plan"]


@dataclass
class Check:
    check: str
    value: float | int | bool | str | None
    threshold: str
    passed: bool

    def line(self) -> str:
        row = {"check": self.check, "value": self.value, "threshold": self.threshold}
        return json.dumps(row | {"pass": "PASS" if self.passed else "FAIL"})


# ---------------------------------------------------------------- pipeline checks
def corpus(n: int) -> list[dict]:
    """Regular multi-turn chats a small target learns in seconds (no download)."""
    nouns = "river stone cloud lamp garden engine violin harbor pepper ladder".split()
    verbs = "paints carries follows hides lifts measures".split()
    rows = []
    for i in range(n):
        a, b, v = nouns[i % 10], nouns[(i * 7 + 3) % 10], verbs[i % 6]
        messages = []
        for t in range(1 + i % 3):
            messages.append({"role": "user", "content": f"what does the {a} do with the {b}? {t}"})
            answer = f"the {a} {v} the {b}, and then the {b} {v} the {a} again {t}"
            messages.append({"role": "assistant", "content": answer})
        rows.append({"id": f"chat-{i}", "messages": messages})
    return rows


def pipeline_params(smoke: bool) -> dict:
    """Small enough for minutes, large enough for several steps per epoch and real blocks."""
    hidden = 64 if smoke else 256
    return {
        "data": {"source": "data/raw/corpus.jsonl", "eval_fraction": 0.1,
                 "max_seq_len": 96 if smoke else 256, "max_conversations": None,
                 "regenerate": False},
        "tokenizer": {"vocab_size": 320 if smoke else 1024},
        "target": {"num_hidden_layers": 6, "hidden_size": hidden, "intermediate_size": 2 * hidden,
                   "num_attention_heads": 4, "num_key_value_heads": 2,
                   "pretrain_epochs": 1, "pretrain_batch_tokens": 2048, "pretrain_lr": 1.0e-2,
                   "end_token_weight": 1.0},
        "drafter": {"block_size": 4 if smoke else 16, "num_hidden_layers": 1,
                    "num_target_features": 2 if smoke else 3,
                    "anchors_per_sequence": 6 if smoke else 16},
        "batching": {"strategy": "packed", "token_budget": 384 if smoke else 1024,
                     "max_batch_size": 8, "slot_cost": 0.5},
        # The smoke's few steps load in the rank: a spawned loader worker's start would be
        # most of its time (the suite's worker tests cover that path).
        "train": {"epochs": 1 if smoke else 3, "world_size": 1, "checkpoint_every": 4,
                  "num_workers": 0 if smoke else 1, "lr": 3.0e-3},
        "evaluate": {"num_prompts": 8, "max_new_tokens": 12 if smoke else 32},
        "logging": {"wandb": "disabled", "every": 1},
    }  # fmt: skip


def stage(workspace: Path, name: str, *overrides: str, torchrun: bool = False, env=None, **popen):
    """``dflash NAME`` in the workspace, or one ``torchrun`` rank of it, in ``env`` (this
    process's environment by default); returns the process."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd = [sys.executable, *(launcher if torchrun else []), "-m", "dflash.cli", name]
    cmd += [f"--set={o}" for o in overrides]
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=workspace, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            **popen)  # fmt: skip


def finish(proc: subprocess.Popen, what: str, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited {proc.returncode}:\n{out[-4000:]}")
    return out


def build_workspace(root: Path, smoke: bool) -> Path:
    workspace = root / "base"
    (workspace / "data/raw").mkdir(parents=True)
    with open(workspace / "data/raw/corpus.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in corpus(200 if smoke else 1200))
    (workspace / "params.yaml").write_text(yaml.safe_dump(pipeline_params(smoke)))
    script = (
        "from dflash.cli import run_stage; from dflash.config.params import load_config; "
        f"config = load_config('params.yaml', []); [run_stage(s, config) for s in {DATA_STAGES}]"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=workspace, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    finish(proc, "the data stages")  # one process: the stages' imports are paid once
    return workspace


def losses(workspace: Path) -> dict[int, float]:
    with open(workspace / "plots/train/log.csv") as f:
        return {int(row["step"]): float(row["loss"]) for row in csv.DictReader(f)}


def train_copy(base: Path, name: str, *overrides: str) -> Path:
    workspace = base.parent / name
    shutil.copytree(base, workspace, symlinks=True)
    finish(stage(workspace, "train", *overrides, torchrun=True), f"train ({name})")
    return workspace


def kill_after_checkpoint(workspace: Path, step: int) -> bool:
    """Start training, SIGKILL the whole process group while its rank holds after checkpoint
    ``step`` (``tests/hold.py``), so the kill lands mid-run however fast the device; whether
    it did."""
    spec = importlib.util.spec_from_file_location("hold", REPO / "tests" / "hold.py")
    hold_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hold_module)
    hold = hold_module.Hold(workspace.with_name(workspace.name + "-hold"))
    proc = stage(workspace, "train", torchrun=True, env=hold.env(step))
    try:
        hold.wait(proc, timeout=600)
        killed = True
    except AssertionError:  # the run ended, or never got there: no kill to resume from
        killed = False
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return killed


def relative_gap(a: dict[int, float], b: dict[int, float], steps) -> float:
    return max(abs(a[s] - b[s]) / max(abs(a[s]), 1e-12) for s in steps)


def pipeline_checks(root: Path, smoke: bool) -> list[Check]:
    base = build_workspace(root, smoke)
    ddp = train_copy(base, "ddp", "train.parallelism=ddp")
    reference = losses(ddp)
    steps = sorted(reference)
    least = 6 if smoke else 40
    checks = [Check("ddp_steps", len(steps), f">= {least}", len(steps) >= least)]
    fsdp = losses(train_copy(base, "fsdp", "train.parallelism=fsdp"))
    gap = relative_gap(reference, fsdp, steps)
    checks.append(Check("fsdp_vs_ddp_loss_rel", gap, "<= 2e-2", gap <= 2e-2))

    resumed = base.parent / "resume"
    shutil.copytree(base, resumed, symlinks=True)
    killed = kill_after_checkpoint(resumed, 4)
    out = finish(stage(resumed, "train", torchrun=True), "train (resume)")
    later = [s for s in steps if s > 4]
    again = losses(resumed)
    gap = max((abs(again[s] - reference[s]) for s in later), default=float("inf"))
    ok = killed and "resumed at" in out and gap <= 1e-3
    checks.append(Check("resume_later_loss_abs", gap, "<= 1e-3 after SIGKILL at step 4", ok))

    finish(stage(ddp, "evaluate", "evaluate.num_prompts=8"), "evaluate")
    metrics = json.loads((ddp / "metrics/eval.json").read_text())
    mismatches = metrics["lossless_mismatches"]
    checks.append(Check("evaluate_lossless_mismatches", mismatches, "== 0 on 8 prompts",
                        mismatches == 0))  # fmt: skip
    tau = metrics["acceptance_length"]
    floor = 1.0 if smoke else 1.05  # the smoke drafter trains a few steps: τ 1 is its due
    checks.append(Check("evaluate_tau", tau, f">= {floor}", tau >= floor))
    return checks


# ---------------------------------------------------------------- kernel checks
def cuda_measure(build, anchors, docs, block_size: int, repeats: int = 3) -> dict:
    """``flex_mask.measure`` on the device: its allocator's peak, and synchronised times."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    build(anchors, docs, block_size, docs.shape[1])
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - before) / 2**20
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        build(anchors, docs, block_size, docs.shape[1])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return {"extra_peak_mib": round(extra, 1), "ms": round(min(times) * 1e3, 1)}


def kernel_checks(smoke: bool) -> list[Check]:
    """The mask at the recipe's shape; on CUDA, flex against the two-part kernel and bf16."""
    import torch
    from flex_mask import layout, measure

    from dflash.model.drafter_attention import flex_block_mask

    tokens, documents, anchors = (1024, 4, 64) if smoke else (8192, 4, 512)
    shape = layout(tokens, documents, anchors, 16)
    if torch.cuda.is_available():
        mask = cuda_measure(flex_block_mask, *(t.cuda() for t in shape), 16)
    else:
        mask = measure(flex_block_mask, *shape, 16, repeats=3)
    ms = mask["ms"]
    # --smoke reports the time and gates nothing on it: a shared CPU's time is no kernel's.
    build = Check("mask_build_ms", ms, *(("reported", True) if smoke else ("<= 50", ms <= 50)))
    checks = [
        Check("mask_extra_peak_mib", mask["extra_peak_mib"], "<= 64", mask["extra_peak_mib"] <= 64),
        build,
    ]
    if not torch.cuda.is_available():
        return checks
    import gpu_check_model

    figures = gpu_check_model.figures()
    limits = {
        "flex_vs_two_part_loss_abs_diff": 1e-4,
        "flex_vs_two_part_grad_rel_diff": 1e-3,
        "bf16_vs_fp32_loss_rel_diff": 2e-2,
    }
    checks += [Check(k, figures[k], f"<= {v}", figures[k] <= v) for k, v in limits.items()]
    checks.append(Check("generate_lossless_fp32", figures["generate_lossless_fp32"], "true",
                        figures["generate_lossless_fp32"]))  # fmt: skip
    return checks


# ---------------------------------------------------------------- step checks
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 tensor-core peaks by device name, for MFU; an unknown device reports none."""


def step_model(smoke: bool, device):
    """A random Qwen3-shaped target and its drafter, sized to fill a GPU step or a CPU smoke."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.model.drafter import DFlashDrafter

    hidden, layers, vocab = (64, 6, 320) if smoke else (1024, 12, 32000)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=hidden // 8, max_position_embeddings=8192)  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = Qwen3ForCausalLM(config).to(device, dtype).eval().requires_grad_(False)
    drafter = DFlashDrafter.from_target(
        target,
        block_size=16,
        num_hidden_layers=1,
        num_target_features=3,
        mask_token_id=vocab - 1,
        seed=0,
    )
    return target, drafter.to(device)  # fmt: skip


def step_shapes(smoke: bool, vocab: int) -> tuple[dict, list[list[list[tuple[int, int, int]]]]]:
    """Twelve packed micro-batches of different shapes over one random token store."""
    import numpy as np

    rng = np.random.default_rng(0)
    scale = 1 if smoke else 16
    lengths = rng.integers(40 * scale, 200 * scale, 48)
    store = {i: (rng.integers(1, vocab - 1, n), (rng.random(n) < 0.7).astype(np.int64))
             for i, n in enumerate(lengths)}  # fmt: skip
    batches, sample = [], 0
    for step in range(12):
        rows = []
        for _ in range(1 + step % 3):
            row, offset = [], 0
            for _ in range(1 + step % 4):
                n = int(lengths[sample % 48])
                row.append((sample % 48, offset, n))
                offset, sample = offset + n, sample + 1
            rows.append(row)
        batches.append(rows)
    return store, batches


def step_checks(smoke: bool) -> list[Check]:
    """Twelve varied-shape training steps: host reads, memory and model FLOP/s on the device."""

    import torch
    from syncs import HostReads

    from dflash.features.sources.colocated import ColocatedFeatures
    from dflash.model.drafter import drafter_autocast
    from dflash.train.batches import build_micro_batch
    from dflash.train.distributed.process_group import Dist
    from dflash.train.step import forward_backward

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target, drafter = step_model(smoke, device)
    store, plans = step_shapes(smoke, target.config.vocab_size)
    flex = device.type == "cuda"
    kw = dict(block_size=16, anchors_per_sequence=8 if smoke else 128, gamma=7.0, seed=0, epoch=0)
    batches = [build_micro_batch(store, rows, **kw, flex=flex) for rows in plans]
    ctx = Dist(rank=0, world_size=1, local_rank=0, device=device)
    autocast = drafter_autocast(device)
    features = ColocatedFeatures(target, drafter.config.target_layer_ids)
    from dflash.model.drafter_attention import flex_compiles

    if flex:
        torch.cuda.reset_peak_memory_stats()
    reads, began, flops, compiled = 0, time.perf_counter(), 0.0, flex_compiles()
    for mb in batches:
        mb = mb.to(device)
        with HostReads() as counted:
            forward_backward(ctx, drafter, [mb], features, 7.0, autocast)
        reads = max(reads, len(counted.reads))
        flops += step_flops(target, drafter, mb)
    if flex:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    checks = [Check("step_host_reads_per_micro_batch", reads, "<= 2", reads <= 2)]
    compiles = flex_compiles() - compiled
    checks.append(Check("step_flex_compiles", compiles, "<= 2 over 12 shapes", compiles <= 2))
    if not flex:
        return checks
    peak = torch.cuda.max_memory_allocated() / 2**30
    ratio = torch.cuda.memory_reserved() / max(torch.cuda.memory_allocated(), 1)
    name = torch.cuda.get_device_name()
    peak_flops = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    mfu = None if peak_flops is None else round(flops / seconds / peak_flops, 3)
    checks += [
        Check("step_peak_allocated_gib", round(peak, 2), "reported", True),
        Check("step_reserved_over_allocated", round(ratio, 2), "<= 2", ratio <= 2),
        Check("step_mfu_incl_compiles", mfu, f"reported ({name})", True),
    ]
    return checks


def step_flops(target, drafter, mb) -> float:
    """Model FLOPs of one step: the target's forward over its tokens, the drafter's forward and
    backward over its block slots, the LM head's over the slots' labels (no attention terms)."""
    params = sum(p.numel() for p in target.model.layers.parameters())
    drafter_params = sum(p.numel() for n, p in drafter.named_parameters() if p.requires_grad)
    slots = int((mb.anchors >= 0).sum()) * 16
    head = target.config.vocab_size * target.config.hidden_size
    return 2 * params * mb.padded_tokens + 6 * drafter_params * slots + 6 * head * slots


# ---------------------------------------------------------------- engine check
def engine_checks(url: str, target_dir: str, n_features: int, states: str) -> list[Check]:
    """A vLLM ``extract_hidden_states`` server's features of a few documents against the same
    target's colocated ones (docs/engines.md): the relative error of bf16 engines' states."""
    import torch

    from dflash.features.engine_client import EngineClient, hidden_transfer
    from dflash.features.target_forward import target_features
    from dflash.model.layer_ids import engine_layer_ids, target_layer_ids
    from dflash.model.load import load_target

    target = load_target(target_dir, device="cuda" if torch.cuda.is_available() else "cpu")
    text = target.config.get_text_config()
    layers = target_layer_ids(text.num_hidden_layers, n_features)
    dtype = target.get_input_embeddings().weight.dtype
    transfer = hidden_transfer("file", Path(states))
    client = EngineClient([url], transfer, len(layers), text.hidden_size, dtype)
    worst = 0.0
    for length in (17, 300, 2048):
        ids = torch.randint(100, min(text.vocab_size, 30000), (1, length))
        served = client.states(ids[0].tolist(), f"a {length}-token document").float()
        ids = ids.to(target.device)
        positions = torch.arange(length, device=target.device)[None]
        ours = target_features(target, ids, positions, ids * 0, layers)[0].float().cpu()
        worst = max(worst, float((served - ours).norm() / ours.norm()))
    note = f"layers {layers}, served as {engine_layer_ids(layers)}"
    return [Check(f"engine_features_rel_error ({note})", worst, "< 0.02", worst < 0.02)]


# ---------------------------------------------------------------- driver
def run_all(groups: dict[str, Callable[[], list[Check]]]) -> int:
    failed = 0
    for name, group in groups.items():
        try:
            checks = group()
        except Exception as err:  # a crashed group is a failed check, and the others still run
            checks = [Check(name, f"{type(err).__name__}: {err}"[-2000:], "runs", False)]
        for check in checks:
            print(check.line(), flush=True)
            failed += not check.passed
    return 1 if failed else 0


def main() -> int:
    from dflash.pipeline.workspace import RELATIVE

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs without a GPU")
    parser.add_argument("--keep", action="store_true", help="keep the temporary workspaces")
    parser.add_argument("--engine-url", help="a vLLM extract_hidden_states server's /v1 URL")
    parser.add_argument("--engine-target", help="the model directory that server serves")
    parser.add_argument("--engine-features", type=int, default=5, help="layers it extracts")
    parser.add_argument(
        "--engine-states",
        default=str(RELATIVE.hidden_states),
        help="where that server's connector writes (its shared_storage_path)",
    )
    args = parser.parse_args()
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(Check("cuda_available", False, "a CUDA device (or --smoke)", False).line())
        return 1
    root = Path(tempfile.mkdtemp(prefix="dflash-acceptance-"))
    try:
        groups = {
            "kernels": lambda: kernel_checks(args.smoke),
            "steps": lambda: step_checks(args.smoke),
            "pipeline": lambda: pipeline_checks(root, args.smoke),
        }
        if args.engine_url:
            groups["engine"] = lambda: engine_checks(
                args.engine_url, args.engine_target, args.engine_features, args.engine_states
            )
        return run_all(groups)
    finally:
        if args.keep:
            print(f"workspaces kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
