"""Generated tokens/s of regenerate in process vs through a ``transformers serve`` server.

One run, same cores: the regenerate stage first in process (``regenerate.batch_size`` prompts
per ``generate``), then through one local server of the same target at each concurrency
(conversations in flight). The rate is the report's: generated tokens over the seconds spent
making shards (model load and health check excluded). Prints a table.

    .venv/bin/python bench/regenerate_throughput.py [--workspace .] [--conversations 64]

``--workspace`` needs ``models/target``, ``models/tokenizer`` and
``data/ingested/conversations.parquet`` (``dvc repro target``); without them the default
target is built in a temporary folder, pretrained one epoch on those rows only (its answers
often run to the cap: the rate per token is what is measured). ``--continuous-batching``
passes that flag to the server. Both backends use the threads ``dflash.threads`` picks (all
cores, or ``OMP_NUM_THREADS``: set it to 1 on a machine busy with other work).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from local_server import LocalServer

from dflash.cli import run_stage
from dflash.config.params import load_config
from dflash.data.conversations import read_conversations, write_conversations
from dflash.pipeline.workspace import RELATIVE
from dflash.threads import set_cpu_threads

PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"
INPUTS = (RELATIVE.target, RELATIVE.tokenizer, RELATIVE.conversations)


def stage(directory: Path, name: str, overrides: list[str]) -> dict:
    """Run stage ``name`` in ``directory``; the regenerate report, when there is one."""
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        run_stage(name, load_config(PARAMS, overrides))
    finally:
        os.chdir(cwd)
    report = directory / RELATIVE.regenerate_report
    return json.loads(report.read_text()) if report.exists() else {}


def inputs(workspace: Path, scratch: Path, conversations: int) -> Path:
    """A folder holding the target, the tokenizer and ``conversations`` training rows."""
    out = scratch / "inputs"
    if all((workspace / p).exists() for p in INPUTS):
        for p in (RELATIVE.target, RELATIVE.tokenizer):
            shutil.copytree(workspace / p, out / p)
        rows = read_conversations(workspace / RELATIVE.conversations)
        (out / RELATIVE.conversations).parent.mkdir(parents=True, exist_ok=True)
        write_conversations(rows[:conversations], out / RELATIVE.conversations)
        return out
    print(f"{workspace}: no trained target; building the default target, one epoch")
    out.mkdir()
    built = [f"data.max_conversations={conversations}", "target.pretrain_epochs=1"]
    for name in ("ingest", "tokenizer", "target"):
        stage(out, name, built)
    return out


def measure(source: Path, scratch: Path, name: str, overrides: list[str]) -> dict:
    """One regenerate run from scratch on a fresh copy of ``source``."""
    directory = scratch / name
    shutil.copytree(source, directory)
    return stage(directory, "regenerate", ["data.regenerate=true", *overrides])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", type=Path, default=Path("."))
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--continuous-batching", action="store_true")
    args = parser.parse_args()
    threads = set_cpu_threads()  # the server gets as many: the same cores
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        source = inputs(args.workspace.resolve(), scratch, args.conversations)
        rows.append(("in process", "-", measure(source, scratch, "in_process", [])))
        extra = ["--continuous-batching"] if args.continuous_batching else []
        server = LocalServer(source / RELATIVE.target, scratch / "serve.log", threads, extra)
        try:
            server.wait()
            for n in args.concurrency:
                served = [
                    "regenerate.backend=openai",
                    f"regenerate.endpoints=[{server.url}]",
                    f"regenerate.concurrency={n}",
                ]
                rows.append(("transformers serve", n, measure(source, scratch, f"c{n}", served)))
        finally:
            server.stop()
    print(f"\n{threads} threads, {args.conversations} conversations")
    print("| backend | concurrency | turns | tokens | seconds | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for backend, n, r in rows:
        print(
            f"| {backend} | {n} | {r['turns_regenerated']} | {r['tokens_generated']} | "
            f"{r['seconds']:.1f} | {r['tokens_per_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
