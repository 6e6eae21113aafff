"""One node's ``torchrun``, run in-process so that a failed job ends in one line.

``python -m dflash.train.distributed.agent TIMEOUT_S [torchrun's options] -m dflash.cli train ...``

``torchrun`` alone prints a traceback of its own under the failing rank's line, whatever the
rank said, and its static rendezvous waits as long as its store lets it: 600 s on the head for
a node that never starts, forever on a worker whose port another program answers. Here the
nodes meet first (:func:`meet`), within ``TIMEOUT_S`` (``train.rendezvous_timeout_s``): the head
names the nodes that never came, a worker the head it could not reach, and a port another
program holds is named. A failed job's full report (torchrun's, its log records, the ranks'
tracebacks) goes to the file :data:`FAILURE_LOG` names, and the terminal gets one line: the
failing rank, how it ended, and that file.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from dflash.errors import UserError
from dflash.heap import imports_settled, skip_exit_collection
from dflash.pipeline.lock import EXIT_DIR, FAILURE_LOG

JOINED = "dflash-joined"
"""Key prefix each node sets on the head's store as it arrives (torchrun's keys have others)."""

FIRST_FAILURE = "first-failure"
"""The file in the launcher's ``EXIT_DIR`` naming the global rank that failed first."""

REFUSED = 2
"""The agent's exit status when the nodes did not meet: the user's to fix (start the node,
choose a free port)."""

T = TypeVar("T")


def main(argv: list[str]) -> int:
    skip_exit_collection()
    with imports_settled():
        from torch.distributed import DistError, run
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    timeout_s, args = float(argv[0]), run.parse_args(argv[1:])
    log = Path(os.environ[FAILURE_LOG])
    _log_torch_records(log)
    try:
        _held = meet(args, timeout_s)  # on the head, the store's server: torchrun's uses it
        run.run(args)
    except UserError as err:
        print(f"dflash train: {err}", file=sys.stderr, flush=True)
        os._exit(REFUSED)  # a thread may still wait on a port that never answers
    except ChildFailedError as err:
        append(log, err.format_msg())
        _leave_first_failure(err)
        print(f"dflash train: {_first_failure(err)}; torchrun's report: {log}", file=sys.stderr)
        return 1
    except DistError as err:  # the agents' store, after the nodes met: a node left
        append(log, traceback.format_exc())
        print(f"dflash train: torchrun: {_first_line(err)}; its report: {log}", file=sys.stderr)
        return 1
    return 0


def meet(args, timeout_s: float):
    """Return once every node's agent reached the head's store at ``--rdzv-endpoint``, or raise
    naming who did not, within ``timeout_s``; the store (None on one node)."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import parse_min_max_nnodes

    _, count = parse_min_max_nnodes(args.nnodes)
    rank = int(args.node_rank)
    if args.standalone or args.rdzv_backend != "static" or count == 1:
        return None
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=-1)
    where = f"--rdzv-endpoint {host}:{port}"
    waited = f"within {timeout_s:g} s (train.rendezvous_timeout_s)"
    deadline = time.monotonic() + timeout_s

    def connect() -> TCPStore:
        # multi_tenant: torchrun's own store on this port, made next in this process, shares it
        timeout = timedelta(seconds=timeout_s)
        return TCPStore(
            host, port, count, rank == 0, timeout, wait_for_workers=False, multi_tenant=True
        )

    unreached = (
        f"node {rank} reached no head at {where} {waited}: start the head (node 0) first, and "
        "check that the address is its and that no other program holds the port"
    )
    try:
        store = _bounded(connect, timeout_s, unreached)
    except RuntimeError as err:  # torch's DistNetworkError and DistStoreError
        if "EADDRINUSE" in str(err):
            raise UserError(
                f"{where}: another program on the head holds port {port}; choose a free port "
                "and rerun every node with it"
            ) from None
        raise UserError(unreached if rank else f"{where}: {_first_line(err)}") from None
    store.set(f"{JOINED}/{rank}", "1")
    while rank == 0:
        missing = [n for n in range(1, count) if not store.check([f"{JOINED}/{n}"])]
        if not missing:
            break
        if time.monotonic() > deadline:
            nodes = f"node{'s' * (len(missing) > 1)} {', '.join(map(str, missing))}"
            raise UserError(
                f"{nodes} of {count} did not join at {where} {waited}: start each with the "
                "command printed above"
            )
        time.sleep(0.1)
    return store


def _bounded(call: Callable[[], T], timeout_s: float, late: str) -> T:
    """``call()``, raising ``UserError(late)`` if it has not returned in ``timeout_s`` (it is left
    running: a store client waiting on a port that never answers cannot be interrupted)."""
    result: dict[str, object] = {}

    def target() -> None:
        try:
            result["value"] = call()
        except Exception as err:  # handed to the caller
            result["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)  # the call's own timeout, where it has one, speaks first
    if thread.is_alive():
        raise UserError(late)
    if "error" in result:
        raise result["error"]
    return result["value"]


def first_failure(where: Path) -> int | None:
    """The global rank that failed first, as the agent left it in ``where`` (the launcher's
    ``EXIT_DIR``); None if no rank failed."""
    path = where / FIRST_FAILURE
    return int(path.read_text()) if path.exists() else None


def _leave_first_failure(err: Exception) -> None:
    where = os.environ.get(EXIT_DIR)
    if where:
        rank, _ = _culprit(err)
        (Path(where) / FIRST_FAILURE).write_text(str(rank))


def _culprit(err: Exception) -> tuple[int, Any]:
    """The failed rank to name: one a signal killed, else the one ``torchrun`` saw first. A rank
    killed (SIGKILL, a crash) leaves its peers failing on closed connections, and a peer's
    failure can be seen first: the killed one is the cause. SIGTERM is torchrun's own stop of
    the survivors, no cause."""
    killed = [
        (rank, f)
        for rank, f in sorted(err.failures.items())
        if f.exitcode < 0 and -f.exitcode != signal.SIGTERM
    ]
    return killed[0] if killed else err.get_first_failure()


def _first_failure(err: Exception) -> str:
    """The failed rank to name (:func:`_culprit`), and how it ended."""
    rank, failure = _culprit(err)
    ended = (
        f"was killed by {failure.signal_name()}"
        if failure.exitcode < 0
        else f"exited {failure.exitcode}"
    )
    return f"rank {rank} {ended}"


def _first_line(err: Exception) -> str:
    return next(iter(str(err).strip().splitlines()), type(err).__name__)


def _log_torch_records(log: Path) -> None:
    """torch.distributed's log records (a rank failed, the others are stopped) to ``log``, not
    the terminal: the one line says where they are."""
    handler = logging.FileHandler(log, delay=True)  # the file is made by a first record only
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("torch.distributed")
    for terminal in list(logger.handlers):  # torch's own, to stderr
        logger.removeHandler(terminal)
    logger.addHandler(handler)
    logger.propagate = False


def append(log: Path, text: str) -> None:
    """Add ``text`` to the failure log in one write: the agent and its ranks share it."""
    with open(log, "a") as f:
        f.write(text.rstrip("\n") + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
