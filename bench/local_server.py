"""``transformers serve`` of a local model directory on a free loopback port, for tests and
benchmarks of the openai backend without a GPU engine.

The server is a child process, bound to 127.0.0.1 only, given one CPU thread by default
(several servers and the client share the cores: more threads would only spin against each
other), and waited for with a bounded deadline: a server that dies or stays silent is an
error naming its log, never a hang.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT_S = 120.0
"""Longest wait for ``/health`` to answer: importing and loading take ~15 s on 2 busy cores."""


def die_with_parent() -> None:
    """Ask Linux to kill this (child) process when its parent dies, however it dies: a server
    must not outlive the test or benchmark that started it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    """A loopback port nothing listens on now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalServer:
    """One ``transformers serve`` child process serving ``model_dir``."""

    def __init__(
        self, model_dir: str | Path, log: Path, threads: int = 1, extra: list[str] = ()
    ) -> None:
        self.model = str(model_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = log
        command = [
            str(Path(sys.executable).with_name("transformers")),
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            *extra,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )

    def wait(self, timeout_s: float = START_TIMEOUT_S) -> LocalServer:
        """Return once ``/health`` answers; raise if the server exits or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"transformers serve exited: see {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"transformers serve not up after {timeout_s:.0f} s: see {self.log}")

    def stop(self) -> None:
        """Kill the server (as a crash would) and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


@contextmanager
def local_servers(model_dir: str | Path, count: int, logs: Path, threads: int = 1):
    """``count`` servers of ``model_dir``, started together and stopped on exit."""
    logs.mkdir(parents=True, exist_ok=True)
    servers = [LocalServer(model_dir, logs / f"serve_{i}.log", threads) for i in range(count)]
    try:
        for server in servers:
            server.wait()
        yield servers
    finally:
        for server in servers:
            server.stop()
