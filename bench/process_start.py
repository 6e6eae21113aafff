"""CPU time of a process that imports a training rank's stack and exits, with and without
:mod:`dflash.heap`; prints a Markdown table of medians, as ratios to the plain process.

Every rank, launcher, loader worker and stage process pays this before and after its work;
on the tiny workspace a two-rank run's training itself is under a second.

    .venv/bin/python bench/process_start.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys

IMPORTS = (
    "import dflash.cli, dflash.stages.train\n"
    "from dflash.train.distributed.node_checks import agree_params\n"
    "from dflash.train.distributed.process_group import init_distributed\n"
    "from dflash.train.loop import train\n"
)

VARIANTS = {
    "plain": IMPORTS,
    "exit collection skipped": "from dflash.heap import skip_exit_collection\n"
    + "skip_exit_collection()\n"
    + IMPORTS,
    "imports settled, exit skipped": "from dflash.heap import imports_settled, "
    + "skip_exit_collection\nskip_exit_collection()\nwith imports_settled():\n"
    + "".join(f"    {line}\n" for line in IMPORTS.splitlines()),
}


def cpu_seconds(script: str) -> float:
    """User + system CPU of one ``python -c script``, exit included."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", script], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cpu_seconds(IMPORTS)  # the first start reads the files from disk
    runs = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):  # interleaved: drift on a shared machine hits each alike
        for name, script in VARIANTS.items():
            runs[name].append(cpu_seconds(script))
    plain = statistics.median(runs["plain"])
    print(f"| process ({args.repeats} runs each) | CPU-s, median | ratio to plain |")
    print("|---|---:|---:|")
    for name, seconds in runs.items():
        median = statistics.median(seconds)
        print(f"| {name} | {median:.2f} | {median / plain:.2f} |")


if __name__ == "__main__":
    main()
