"""CI check that dvc.yaml declares the pipeline exactly: run it, then change one thing at a time.

In a temporary copy of the working tree, with tiny params and a few dozen conversations under
``data/raw``: ``dvc repro`` must leave ``dvc status`` clean; then each change below must
invalidate exactly the stages expected of it (computed from the code's import closures and
the stages' declared params, not written out by hand), and undoing it must leave status clean.

    python tests/ci_declaration.py        # about 2-3 minutes on two CPU cores
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from conftest import TINY_PARAMS, tiny_corpus
from declaration import ROOT, readers_of

from dflash.pipeline.declaration import stages

CORPUS = "data/raw/corpus.jsonl"
TINY = {
    **TINY_PARAMS,
    "data": {**TINY_PARAMS["data"], "source": CORPUS},
    "train": {**TINY_PARAMS["train"], "epochs": 1, "world_size": 1},
}
# DVC wants every declared param in the file: the committed params, with the tiny ones over.
PARAMS = {
    section: {**values, **TINY.get(section, {})}
    for section, values in yaml.safe_load((ROOT / "params.yaml").read_text()).items()
}


def run(repo: Path, *cmd: str) -> str:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(repo),  # the copy's code, not the installed checkout's
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
    }
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def copy_worktree(repo: Path) -> None:
    """Tracked and untracked-but-not-ignored files: what a commit of this tree would hold."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, repo / name)


def stale(repo: Path) -> set[str]:
    return set(json.loads(run(repo, "dvc", "status", "--json") or "{}"))


def expect(repo: Path, change: str, edit: tuple[str, str], expected: set[str]) -> None:
    """Write ``edit`` (path, new text), compare what dvc status invalidates, undo it."""
    path = repo / edit[0]
    before = path.read_bytes()
    path.write_text(edit[1])
    got = stale(repo)
    path.write_bytes(before)
    if got != expected:
        sys.exit(f"{change}: dvc status invalidates {sorted(got)}, expected {sorted(expected)}")
    if stale(repo):
        sys.exit(f"{change}: undoing it left dvc status dirty: {sorted(stale(repo))}")
    print(f"ok  {change}: {sorted(got) or 'nothing'}")


def appended(repo: Path, name: str, text: str) -> tuple[str, str]:
    return name, (repo / name).read_text() + text


def param_edit(key: str, value) -> tuple[str, str]:
    """params.yaml with ``key`` set to ``value``."""
    section, leaf = key.split(".")
    params = json.loads(json.dumps(PARAMS))
    params[section][leaf] = value
    return "params.yaml", yaml.safe_dump(params)


def params_readers(key: str) -> set[str]:
    section = key.split(".")[0]
    return {n for n, s in stages().items() if key in s.params or section in s.params} - {"report"}


def main() -> None:
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        copy_worktree(repo)
        (repo / "params.yaml").write_text(yaml.safe_dump(PARAMS))
        with open(repo / CORPUS, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in tiny_corpus(40))
        run(repo, "git", "init", "-q")
        # A first commit, as any user's repository has: DVCLive reads HEAD when it starts.
        run(repo, "git", "add", "-A")
        run(
            repo,
            "git",
            "-c",
            "user.name=ci",
            "-c",
            "user.email=ci@localhost",
            "commit",
            "-qm",
            "base",
        )
        run(repo, "dvc", "repro")
        if stale(repo):
            sys.exit(f"dvc status after dvc repro: {sorted(stale(repo))} still changed")
        print(f"ok  dvc repro, then dvc status clean ({time.perf_counter() - began:.0f} s)")
        for module in (
            "dflash/pipeline/workspace.py",
            "dflash/batching/io.py",
            "dflash/model/generate.py",
            "dflash/commands/report.py",
        ):
            change = appended(repo, module, "\n# ci\n")
            expect(repo, f"comment in {module}", change, readers_of(module))
        expect(repo, f"a line of {CORPUS}", appended(repo, CORPUS, "\n"), {"ingest"})
        prompts = appended(repo, "data/prompts/README.md", "\n")
        expect(repo, "a file under data/prompts", prompts, {"evaluate"})
        init = appended(repo, "models/init/README.md", "\n")
        # capture too: the tapped layers of a drafter initialised from there are its features'
        expect(repo, "a file under models/init", init, {"capture", "train"})
        expect(repo, "knob train.num_workers", param_edit("train.num_workers", 2), set())
        for key, value in (("train.lr", 1e-3), ("batching.seed", 3), ("data.max_seq_len", 80)):
            expect(repo, f"param {key}", param_edit(key, value), params_readers(key))
    print(f"declaration holds ({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
