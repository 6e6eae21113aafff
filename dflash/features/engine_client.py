"""Target hidden states from serving engines, read with the ``hs-connectors`` library.

vLLM started with the ``extract_hidden_states`` speculative method runs a prompt's prefill,
and its hs-connectors KV-transfer connector hands the chosen layers' states on: a safetensors
file holding ``hidden_states`` ``[T, n, H]`` and the prompt's ``token_ids``. One document is
one ``POST /completions`` with its token ids as the prompt and ``max_tokens`` 1; the response's
``kv_transfer_params`` name the file, and the library reads it. The answer is untrusted: its
file must lie inside the transfer's directory (else it is neither read nor deleted), the whole
exchange has one deadline, and the states are checked against what was asked (tokens, shape,
dtype, finite and not all zero) before anything trains on them. A failed document is retried
on the next endpoint; the last failure names the endpoint and why.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import socket
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from dflash.config.schema import EngineConfig
from dflash.errors import ConfigError, UserError

BACKOFF_S = 0.5
"""First wait before a retry, doubled each time."""

QUOTED_CHARS = 300
"""How much of an error answer's body a failure quotes."""


class EngineError(UserError, RuntimeError):
    """A document's hidden states could not be had: the run cannot go on without them. One line
    naming the document, the endpoint and why (exit 2, no traceback)."""


class BadStates(ValueError):
    """An answer or a file that is not the states asked for (shape, dtype, tokens, values)."""


def hidden_transfer(backend: str, directory: Path):
    """The hs-connectors reader of ``backend``, of the files in ``directory`` (the workspace's
    ``hidden_states``, where the servers' connector writes): exit-2 material when it cannot be
    had. The client reads and deletes files in that directory only."""
    try:
        import hs_connectors
    except ImportError as err:
        raise ConfigError(
            f"engine.backend = {backend}: needs the hs-connectors package "
            "(pip install 'dflash[engine]', Python >= 3.11)"
        ) from err
    if backend == "file":
        return hs_connectors.FileTransfer(Path(directory))
    try:
        import mooncake.store  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            "engine.backend = mooncake: the Mooncake transfer engine is not installed "
            "(pip install 'mooncake-transfer-engine>=0.3.12'); use engine.backend file on a "
            "filesystem shared with the servers"
        ) from err
    raise ConfigError(
        "engine.backend = mooncake: its store address is not configured by these params; "
        "use engine.backend file"
    )


def checked(
    sample: dict[str, torch.Tensor] | None,
    token_ids: list[int],
    layers: int,
    hidden: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The states ``[T, layers * hidden]`` of ``sample``, or :class:`BadStates` saying why not."""
    if sample is None:
        raise BadStates("no hidden-states file")
    if "hidden_states" not in sample or "token_ids" not in sample:
        raise BadStates(f"the file holds {sorted(sample)}, not hidden_states and token_ids")
    states, tokens = sample["hidden_states"], sample["token_ids"]
    want = (len(token_ids), layers, hidden)
    if tuple(states.shape) != want:
        raise BadStates(f"hidden_states have shape {tuple(states.shape)}, expected {want}")
    if states.dtype != dtype:
        raise BadStates(f"hidden_states have dtype {states.dtype}, expected {dtype}")
    if tokens.tolist() != list(token_ids):
        raise BadStates(f"the file is of other tokens ({tokens.numel()} of them): a stale file")
    if not bool(torch.isfinite(states).all()):
        raise BadStates("hidden_states hold NaN or infinity")
    if states.numel() and not bool(states.any()):
        raise BadStates("hidden_states are all zero")
    return states.reshape(len(token_ids), layers * hidden)


def states_path(directory: Path, handle: object) -> Path:
    """The file ``handle`` names (relative: to ``directory``), links followed, if it lies inside
    ``directory``; else :class:`BadStates` naming it. A server's answer may have the client read
    and delete the files its connector writes there, and nothing else."""
    if not isinstance(handle, str) or not handle:
        raise BadStates(f"hidden_states_path {handle!r} is no path: refused")
    root = Path(directory).resolve()
    path = (root / handle).resolve()
    if path == root or not path.is_relative_to(root):
        raise BadStates(
            f"hidden_states_path {handle!r} is outside {root}: refused, neither read nor deleted"
        )
    return path


def read_states(transfer: Any, path: Path, deadline: float) -> dict[str, torch.Tensor] | None:
    """The tensors of ``path`` (None when there is none), once the connector's lock on it is
    released: waited for until ``deadline`` (``time.monotonic()``), as the answer was."""
    from hs_connectors.transfer import wait_for_lock

    lock = Path(f"{path}.lock")
    if lock.exists():
        wait_for_lock(str(lock), timeout=max(deadline - time.monotonic(), 0.0))
    if path.exists() and not path.is_file():
        raise BadStates(f"{path} is no regular file: refused")
    try:
        return transfer.get_generated({"hidden_states_path": str(path)})
    except SafetensorError as err:
        raise BadStates(f"{path} is unreadable: SafetensorError: {err}") from err


def post(url: str, body: bytes, deadline: float) -> bytes:
    """The body of the answer to ``POST url``, whole before ``deadline`` (``time.monotonic()``):
    a watchdog shuts the socket then, however slowly the server sends, and it is a timeout."""
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    left = max(deadline - time.monotonic(), 0.001)
    conn = kind(parts.hostname, parts.port, timeout=left)
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        sock = conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(left, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request("POST", parts.path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
    except (OSError, http.client.HTTPException):
        if not expired.is_set():
            raise
    finally:
        watchdog.cancel()
        conn.close()
    if expired.is_set():
        raise TimeoutError(f"no whole answer within {left:.3g} s (engine.timeout_s)")
    if not 200 <= response.status < 300:
        text = " ".join(data.decode(errors="replace").split())[:QUOTED_CHARS]
        raise BadStates(f"HTTP {response.status} {response.reason}: {text}")
    return data


class EngineClient:
    """Asks the servers for documents' hidden states; thread-safe, one request per call.

    ``transfer`` reads files (hs-connectors' ``FileTransfer``): only those inside its
    directory are read, then deleted. ``timeout_s`` bounds each document's whole exchange:
    the answer and the wait for its file's lock."""

    def __init__(
        self,
        endpoints: list[str],
        transfer: Any,
        layers: int,
        hidden: int,
        dtype: torch.dtype,
        *,
        model: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 3,
    ) -> None:
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.transfer, self.layers, self.hidden, self.dtype = transfer, layers, hidden, dtype
        self.model, self.timeout_s, self.max_retries = model, timeout_s, max_retries
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self.requests = 0
        """Documents answered: one engine forward each."""

    def states(self, token_ids: list[int], what: str) -> torch.Tensor:
        """``[T, layers * hidden]`` states of one document; ``what`` names it in errors."""
        with self._lock:
            first = next(self._turn)
        failures = []
        for attempt in range(self.max_retries + 1):
            endpoint = self.endpoints[(first + attempt) % len(self.endpoints)]
            try:
                states = self._ask(endpoint, token_ids)
            except FAILED as err:
                reason = " ".join(str(err).split())
                failures.append(f"{endpoint}: {type(err).__name__}: {reason}")
                if attempt < self.max_retries:
                    time.sleep(BACKOFF_S * 2**attempt)
                continue
            with self._lock:
                self.requests += 1
            return states
        raise EngineError(
            f"{what}: no hidden states after {len(failures)} attempts; last at endpoint "
            f"{failures[-1]}"
        )

    def _ask(self, endpoint: str, token_ids: list[int]) -> torch.Tensor:
        deadline = time.monotonic() + self.timeout_s
        body: dict[str, Any] = {"prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0}
        if self.model is not None:
            body["model"] = self.model
        data = post(f"{endpoint}/completions", json.dumps(body).encode(), deadline)
        try:
            reply = json.loads(data)
        except ValueError as err:
            raise BadStates(f"the answer is not JSON ({err})") from err
        params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
        if not isinstance(params, dict):
            raise BadStates(
                "the response has no kv_transfer_params: is the server started with "
                "extract_hidden_states and an hs-connectors connector?"
            )
        handle = params.get("hidden_states_path", params.get("handle"))
        path = states_path(self.transfer.hidden_states_path, handle)
        try:
            sample = read_states(self.transfer, path, deadline)
            return checked(sample, token_ids, self.layers, self.hidden, self.dtype)
        finally:
            if path.is_file():
                with contextlib.suppress(OSError):
                    self.transfer.delete(str(path))  # read once: never left to be read stale


def connect(
    engine: EngineConfig, directory: Path, layers: int, hidden: int, dtype: torch.dtype
) -> EngineClient:
    """The client of the ``engine`` params' servers, for ``layers`` states of ``hidden`` each,
    reading their files in ``directory`` (the workspace's ``hidden_states``)."""
    transfer = hidden_transfer(engine.backend, directory)
    return EngineClient(
        engine.endpoints, transfer, layers, hidden, dtype,
        model=engine.model, timeout_s=engine.timeout_s, max_retries=engine.max_retries,
    )  # fmt: skip


FAILED = (OSError, ValueError, KeyError, http.client.HTTPException)
"""What a failed attempt raises (a timeout is an ``OSError``, :class:`BadStates` a
``ValueError``): retried on the next endpoint, then named in the run's error."""
