"""Target hidden states from serving engines, read with the ``hs-connectors`` library.

vLLM started with the ``extract_hidden_states`` speculative method runs a prompt's prefill,
and its hs-connectors KV-transfer connector hands the chosen layers' states on: a safetensors
file (``file``) or a Mooncake object (``mooncake``) holding ``hidden_states`` ``[T, n, H]`` and
the prompt's ``token_ids``. One document is one ``POST /completions`` with its token ids as
the prompt and ``max_tokens`` 1; the response's ``kv_transfer_params`` say where the states
are, and the library reads them. A document's states are checked against what was asked
(tokens, shape, dtype, finite and not all zero) before anything trains on them, and a failed
document is retried on the next endpoint; the last failure names the endpoint.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

BACKOFF_S = 0.5
"""First wait before a retry, doubled each time."""


class EngineError(RuntimeError):
    """A document's hidden states could not be had: the run cannot go on without them."""


class BadStates(ValueError):
    """An answer or a file that is not the states asked for (shape, dtype, tokens, values)."""


def engine_layer_ids(layer_ids: list[int]) -> list[int]:
    """The ``eagle_aux_hidden_state_layer_ids`` a server needs for the drafter's ``layer_ids``.

    vLLM records aux state ``j`` before decoder layer ``j`` runs (its input, the residual
    stream: the output of layer ``j - 1``, Hugging Face's ``hidden_states[j]``). The drafter
    reads the output of layer ``i``, ``hidden_states[i + 1]``: engine id ``i + 1``.
    """
    return [i + 1 for i in layer_ids]


def hidden_transfer(backend: str, directory: Path | None = None):
    """The hs-connectors reader of ``backend``: exit-2 material when it cannot be had."""
    from dflash.errors import ConfigError

    try:
        import hs_connectors
    except ImportError as err:
        raise ConfigError(
            f"engine.backend = {backend}: needs the hs-connectors package "
            "(pip install 'dflash[engine]', Python >= 3.11)"
        ) from err
    if backend == "file":
        return hs_connectors.FileTransfer(Path(directory or "."))
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
        raise BadStates(f"hidden_states are {tuple(states.shape)}, expected {want}")
    if states.dtype != dtype:
        raise BadStates(f"hidden_states are {states.dtype}, expected {dtype}")
    if tokens.tolist() != list(token_ids):
        raise BadStates(f"the file is of other tokens ({tokens.numel()} of them): a stale file")
    if not bool(torch.isfinite(states).all()):
        raise BadStates("hidden_states hold NaN or infinity")
    if states.numel() and not bool(states.any()):
        raise BadStates("hidden_states are all zero")
    return states.reshape(len(token_ids), layers * hidden)


class EngineClient:
    """Asks the servers for documents' hidden states; thread-safe, one request per call."""

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
            except (OSError, ValueError, KeyError, TimeoutError) as err:
                failures.append(f"{endpoint}: {type(err).__name__}: {err}")
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
        body: dict[str, Any] = {"prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0}
        if self.model is not None:
            body["model"] = self.model
        request = urllib.request.Request(
            f"{endpoint}/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            reply = json.loads(response.read())
        params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
        if not isinstance(params, dict):
            raise BadStates(
                "the response has no kv_transfer_params: is the server started with "
                "extract_hidden_states and an hs-connectors connector?"
            )
        sample = self.transfer.get_generated(params)
        handle = params.get("hidden_states_path") or params.get("handle")
        try:
            return checked(sample, token_ids, self.layers, self.hidden, self.dtype)
        finally:
            if sample is not None and handle:
                with contextlib.suppress(OSError):
                    self.transfer.delete(handle)  # read once: never left to be read stale
