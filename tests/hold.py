"""Hold a training run at a point it cannot pass: once checkpoint ``step`` is written, each
rank that wrote it leaves a ``reached.RANK`` file and waits until the test releases it, or
kills it. A test that kills a run "after checkpoint N" then knows the run was alive and had
not gone past N, however fast or slow the machine.

The hold ships in no dflash module: :meth:`Hold.env` puts a ``sitecustomize`` on the run's
``PYTHONPATH`` (torchrun hands its environment to the ranks), which loads this file and wraps
``dflash.train.checkpointing.checkpoint.save_checkpoint`` as that module is first imported. Stdlib
only:
every process of the run imports it at start.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

STEP, DIRECTORY = "DFLASH_TEST_HOLD_STEP", "DFLASH_TEST_HOLD_DIR"
"""The environment that tells a run's processes where to hold and where to say so."""
MODULE = "dflash.train.checkpointing.checkpoint"

SITE = """import importlib.util
spec = importlib.util.spec_from_file_location("dflash_test_hold", {path!r})
hold = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hold)
hold.install()
"""


class Hold:
    """The test's side: the run's environment, the wait for the hold, the release."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        site = SITE.format(path=str(Path(__file__).resolve()))
        (directory / "sitecustomize.py").write_text(site)

    def env(self, step: int, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (this process's environment by default) for a run held after ``step``."""
        base = dict(os.environ if base is None else base)
        path = os.pathsep.join(p for p in (str(self.directory), base.get("PYTHONPATH")) if p)
        return base | {"PYTHONPATH": path, STEP: str(step), DIRECTORY: str(self.directory)}

    def reached(self, rank: int = 0) -> bool:
        return (self.directory / f"reached.{rank}").exists()

    def wait(self, job: subprocess.Popen, timeout: float = 300) -> None:
        """Return once global rank 0 holds: its checkpoint is whole (the save's last barrier
        is behind it) and no rank can go past it. Fails if the job ends first."""
        deadline = time.monotonic() + timeout
        while not self.reached():
            if job.poll() is not None:
                raise AssertionError(f"the run ended (exit {job.returncode}) before its hold")
            if time.monotonic() > deadline:  # a hang guard, not a measurement
                raise AssertionError(f"the run did not reach its hold in {timeout} s")
            time.sleep(0.02)

    def release(self) -> None:
        """Let held ranks go on; a rank that reaches the hold later does not wait."""
        (self.directory / "release").touch()


def install() -> None:
    """In a process of the run, from its ``sitecustomize``: hold after the named step."""
    if os.environ.get(STEP):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the checkpoint module with the other finders, and wraps it once executed."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            module.save_checkpoint = held(module.save_checkpoint)

        spec.loader.exec_module = exec_module
        return spec


def held(save):
    """``save``, then the hold when the step saved is the one named."""
    step, directory = int(os.environ[STEP]), Path(os.environ[DIRECTORY])
    signature = inspect.signature(save)

    @functools.wraps(save)
    def save_then_hold(*args, **kwargs):
        path = save(*args, **kwargs)
        if signature.bind(*args, **kwargs).arguments["step"] == step:
            (directory / f"reached.{os.environ.get('RANK', '0')}").touch()
            while not (directory / "release").exists():
                time.sleep(0.05)
        return path

    return save_then_hold
