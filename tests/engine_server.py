"""A stand-in for vLLM's ``extract_hidden_states`` server, for tests on CPU.

It speaks the request API the engine client uses (``POST /v1/completions`` with token ids as
the prompt) and writes what hs-connectors' file connector writes (a safetensors file of
``hidden_states`` ``[T, n, H]`` and ``token_ids``, its path in ``kv_transfer_params``). The
states are what vLLM records for its ``eagle_aux_hidden_state_layer_ids`` (:func:`aux_states`),
taken from the tiny target's own decoder layers. ``faults`` makes its next answers fail on
purpose.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
import time
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from safetensors.torch import save_file

FAULTS = (
    "http500",
    "slow",
    "trickle",
    "garbage",
    "bad_json",
    "no_params",
    "missing",
    "truncated",
    "shape",
    "dtype",
    "stale",
    "zeros",
    "nan",
)
"""Named faults; a dict in ``faults`` is answered as the ``kv_transfer_params`` themselves."""

LATE_S = 1.0
"""How late a ``slow`` answer comes, and about how long a ``trickle`` takes: past the tests'
timeouts."""


def aux_states(target: torch.nn.Module, ids: list[int], aux_layer_ids: list[int]) -> torch.Tensor:
    """``[T, n, H]``: what vLLM's ``extract_hidden_states`` records for ``aux_layer_ids``.

    Mirrors the decoder loop of vLLM's ``LlamaModel.forward`` / ``Qwen2Model.forward``
    (``vllm/model_executor/models/llama.py``, ``qwen2.py``; Qwen3 reuses the latter): at layer
    ``idx``, when ``idx`` is one of the aux layers (``set_aux_hidden_state_layers``, from
    ``eagle_aux_hidden_state_layer_ids`` by ``get_eagle3_aux_layers_from_config``), it keeps
    ``hidden_states + residual``, the residual stream entering layer ``idx``, before that layer
    runs, in layer order. Here: the input of each such decoder layer, caught by a pre-hook.
    """
    layers = target.model.layers
    kept: dict[int, torch.Tensor] = {}

    def keep(idx: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            kept[idx] = hidden[0].detach().clone()

        return hook

    handles = [
        layers[idx].register_forward_pre_hook(keep(idx), with_kwargs=True)
        for idx in range(len(layers))
        if idx in aux_layer_ids
    ]
    try:
        with torch.no_grad():
            target(input_ids=torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([kept[idx] for idx in sorted(kept)], dim=1)


class StandInEngine:
    """Serves ``target`` on a free loopback port from a thread; a context manager."""

    def __init__(self, target: torch.nn.Module, aux_layer_ids: list[int], directory: Path) -> None:
        # Its own copy: the feature code cuts and hooks a target's layers while it runs.
        self.target = copy.deepcopy(target)
        self.aux_layer_ids, self.directory = aux_layer_ids, Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.faults: deque[str | dict] = deque()
        """The next answers' faults, one each, in order (then answers are right again)."""
        self.requests = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> StandInEngine:
        serve = functools.partial(self.server.serve_forever, poll_interval=0.02)  # quick to stop
        threading.Thread(target=serve, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def states(self, ids: list[int]) -> torch.Tensor:
        return aux_states(self.target, ids, self.aux_layer_ids)

    def answer(self, body: dict) -> tuple[int, dict | str, str | None]:
        """The status, the JSON answer (or raw text) and the fault it carries."""
        ids = list(body["prompt"])
        with self.lock:
            self.requests += 1
            fault = self.faults.popleft() if self.faults else None
            states = self.states(ids)
        if isinstance(fault, dict):
            return 200, self._reply(fault), None
        if fault == "http500":
            return 500, {"error": "engine overloaded"}, fault
        if fault == "slow":
            time.sleep(LATE_S)
        if fault == "bad_json":
            return 200, '{"kv_transfer_params": {"hidden_states_path": ', fault
        if fault == "no_params":
            return 200, {"choices": [{"text": "", "index": 0}]}, fault
        path = self.directory / f"{uuid.uuid4().hex}.safetensors"
        if fault != "missing":
            self._write(path, states, torch.tensor(ids, dtype=torch.int64), fault)
        return 200, self._reply({"hidden_states_path": str(path)}), fault

    @staticmethod
    def _write(path: Path, states: torch.Tensor, tokens: torch.Tensor, fault: str | None) -> None:
        if fault == "shape":
            states = states[:, :-1]
        if fault == "dtype":
            states = states.to(torch.float16)
        if fault == "stale":
            tokens = tokens.flip(0) + 1
        if fault == "zeros":
            states = torch.zeros_like(states)
        if fault == "nan":
            states = states.clone()
            states[0, 0, 0] = float("nan")
        save_file({"hidden_states": states.contiguous(), "token_ids": tokens}, path)
        if fault == "truncated":
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])

    @staticmethod
    def _reply(params: dict) -> dict:
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "kv_transfer_params": params,
        }

    def _handler(self):
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if self.path.rstrip("/") != "/v1/completions":
                    self.send_error(404)
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, reply, fault = engine.answer(body)
                data = (reply if isinstance(reply, str) else json.dumps(reply)).encode()
                if fault == "garbage":
                    self.wfile.write(b"this is no HTTP answer\r\n\r\n")
                elif fault == "trickle":
                    self._trickle(status, data)
                else:
                    self._send(status, data)

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                try:
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    self.close_connection = True  # the client hung up: it gave up on this answer

            def _trickle(self, status: int, data: bytes) -> None:
                """A right answer, a few bytes at a time, never long silent."""
                head = (
                    f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n"
                ).encode()
                raw, chunk = head + data, 16
                pause = LATE_S * chunk / len(raw)
                try:
                    for at in range(0, len(raw), chunk):
                        self.wfile.write(raw[at : at + chunk])
                        self.wfile.flush()
                        time.sleep(pause)
                except OSError:
                    pass  # the client hung up: it gave up on this answer
                self.close_connection = True

            def log_message(self, *args) -> None:
                pass

        return Handler
