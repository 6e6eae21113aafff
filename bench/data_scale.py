"""Wall time, peak memory and tokens/s of the data stages on a synthetic corpus of any size.

Generates N conversations (mixed lengths with a heavy tail, some tool calls, a few
malformed records and duplicates), then runs ingest -> tokenizer -> regenerate
(pass-through) -> tokenize, each through the stage CLI in a fresh process, so each stage's
peak RSS is its own. Run it at two sizes to see memory stay flat as the corpus grows:

    .venv/bin/python bench/data_scale.py --conversations 50000
    .venv/bin/python bench/data_scale.py --conversations 200000 --workers 1 2 --json

``tokens/s`` is the tokenized store's token count over the stage's wall time (the same
numerator for every stage, so the rates compare). ``peak RSS`` is the stage's main process;
``workers`` is the largest of its child processes (tokenize's workers).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part def "
    "return import self class print value data model train token batch loss error result"
).split()
RUNNER = """
import json, resource, sys, time
from dflash.cli import main
start = time.perf_counter()
code = main(sys.argv[1:])
seconds = time.perf_counter() - start
peak = lambda who: resource.getrusage(who).ru_maxrss / 1024
print(json.dumps({"code": code, "seconds": seconds, "self": peak(resource.RUSAGE_SELF),
                  "children": peak(resource.RUSAGE_CHILDREN)}))
"""


def make_corpus(path: Path, n: int, seed: int = 0) -> int:
    """Write ``n`` records of JSONL (about 1 in 200 malformed or duplicated); returns bytes.

    Message texts are slices of one pool of random words, so generating 200,000
    conversations takes seconds rather than minutes.
    """
    rng = np.random.default_rng(seed)
    pool = " ".join(rng.choice(WORDS, size=2_000_000))
    size, previous = 0, None
    with open(path, "w") as file:
        for i in range(n):
            record = _record(i, rng, pool)
            line = json.dumps(record, ensure_ascii=False)
            if i % 200 == 7:
                line = line[: len(line) // 2]  # truncated: invalid JSON
            elif i % 200 == 13:
                line = json.dumps({"messages": [{"role": "user", "content": "   "}]})
            elif i % 200 == 17:
                line = json.dumps({"messages": previous["messages"]})  # a duplicate
            previous = record
            file.write(line + "\n")
            size += len(line) + 1
    return size


def _record(i: int, rng: np.random.Generator, pool: str) -> dict:
    """A conversation of 1-6 exchanges with log-normal message lengths (median ~250 chars)."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for turn in range(int(rng.integers(1, 7))):
        messages.append({"role": "user", "content": _text(rng, pool, 120)})
        if i % 10 == 3 and turn == 0:
            call = {"name": "search", "arguments": json.dumps({"query": _text(rng, pool, 30)})}
            messages.append({"role": "assistant", "tool_calls": [{"function": call}]})
            messages.append({"role": "tool", "content": _text(rng, pool, 300)})
        messages.append({"role": "assistant", "content": _text(rng, pool, 400)})
    return {"id": f"conv-{i}", "messages": messages}


def _text(rng: np.random.Generator, pool: str, median: int) -> str:
    length = int(min(20_000, max(2, rng.lognormal(np.log(median), 1.0))))
    start = int(rng.integers(0, len(pool) - length))
    return pool[start : start + length].strip() or "ok"


def run_stage(workdir: Path, stage: str, overrides: list[str]) -> dict:
    """Run one stage CLI in a fresh process; its wall time and peak RSS (MiB)."""
    sets = [arg for item in overrides for arg in ("--set", item)]
    command = [sys.executable, "-c", RUNNER, stage, "--params", "params.yaml", *sets]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{stage} failed:\n{done.stderr[-3000:]}")
    usage = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "wall_s": round(wall, 2),
        "stage_s": round(usage["seconds"], 2),
        "peak_rss_mib": round(usage["self"]),
        "workers_peak_rss_mib": round(usage["children"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=50_000)
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[0], help="tokenize worker counts (0 = all)"
    )
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--json", action="store_true", help="one JSON line instead of a table")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        source = Path("data/raw/corpus.jsonl")  # where ingest takes a dataset from
        (workdir / source).parent.mkdir(parents=True, exist_ok=True)
        corpus_bytes = make_corpus(workdir / source, args.conversations)
        generate_s = time.perf_counter() - start
        params = {
            "data": {
                "source": str(source),
                "max_conversations": None,
                "regenerate": False,
                "max_seq_len": args.max_seq_len,
            },
            "tokenizer": {"vocab_size": args.vocab_size},
        }
        (workdir / "params.yaml").write_text(yaml.safe_dump(params))
        stages = {name: run_stage(workdir, name, []) for name in ("ingest", "tokenizer")}
        stages["regenerate"] = run_stage(workdir, "regenerate", [])
        for workers in args.workers:
            value = "null" if workers == 0 else str(workers)
            name = "tokenize" if args.workers == [0] else f"tokenize, data.num_workers={value}"
            stages[name] = run_stage(workdir, "tokenize", [f"data.num_workers={value}"])
        manifest = json.loads((workdir / "data/tokenized/manifest.json").read_text())
        ingest = json.loads((workdir / "data/ingested/ingest_report.json").read_text())

    tokens = manifest["n_tokens"]
    for figures in stages.values():
        figures["tokens_per_s"] = round(tokens / figures["wall_s"])
    result = {
        "conversations": args.conversations,
        "corpus_mb": round(corpus_bytes / 1e6, 1),
        "generate_s": round(generate_s, 1),
        "records_skipped": ingest["skipped_total"],
        "duplicates_removed": ingest["duplicates_removed"]["count"],
        "samples": manifest["n_samples"],
        "tokens": tokens,
        "stages": stages,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{args.conversations:,} conversations, {result['corpus_mb']} MB of JSONL, "
        f"{tokens:,} tokens in {manifest['n_samples']:,} samples "
        f"({result['records_skipped']} malformed, {result['duplicates_removed']} duplicates)"
    )
    print("| stage | wall | peak RSS | workers' peak RSS | tokens/s |")
    print("|---|---|---|---|---|")
    for name, f in stages.items():
        print(
            f"| {name} | {f['wall_s']:.1f} s | {f['peak_rss_mib']} MiB | "
            f"{f['workers_peak_rss_mib']} MiB | {f['tokens_per_s']:,} |"
        )


if __name__ == "__main__":
    main()
