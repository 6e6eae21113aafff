"""A stand-in for vLLM's ``extract_hidden_states`` server, for tests on CPU.

It speaks the request API the engine client uses (``POST /v1/completions`` with token ids as
the prompt) and writes what hs-connectors' file connector writes (a safetensors file of
``hidden_states`` ``[T, n, H]`` and ``token_ids``, its path in ``kv_transfer_params``), from
the tiny target's Hugging Face forward: state ``j`` is ``hidden_states[j]``, the input of
decoder layer ``j``, as vLLM records it. ``faults`` makes its next answers fail on purpose.
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

FAULTS = ("http500", "slow", "no_params", "missing", "shape", "dtype", "stale", "zeros", "nan")


class StandInEngine:
    """Serves ``target`` on a free loopback port from a thread; a context manager."""

    def __init__(self, target: torch.nn.Module, layer_ids: list[int], directory: Path) -> None:
        # Its own copy: the feature code cuts and hooks a target's layers while it runs.
        self.target = copy.deepcopy(target)
        self.layer_ids, self.directory = layer_ids, Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.faults: deque[str] = deque()
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
        with torch.no_grad():
            out = self.target(input_ids=torch.tensor([ids]), output_hidden_states=True)
        return torch.stack([out.hidden_states[j][0] for j in self.layer_ids], dim=1)

    def answer(self, body: dict) -> tuple[int, dict]:
        ids = list(body["prompt"])
        with self.lock:
            self.requests += 1
            fault = self.faults.popleft() if self.faults else None
            states = self.states(ids)
        if fault == "http500":
            return 500, {"error": "engine overloaded"}
        if fault == "slow":
            time.sleep(3.0)
        if fault == "no_params":
            return 200, {"choices": [{"text": "", "index": 0}]}
        path = self.directory / f"{uuid.uuid4().hex}.safetensors"
        tokens = torch.tensor(ids, dtype=torch.int64)
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
        if fault != "missing":
            save_file({"hidden_states": states.contiguous(), "token_ids": tokens}, path)
        reply = {
            "id": f"cmpl-{path.stem}",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "kv_transfer_params": {"hidden_states_path": str(path)},
        }
        return 200, reply

    def _handler(self):
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if self.path.rstrip("/") != "/v1/completions":
                    self.send_error(404)
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, reply = engine.answer(body)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        return Handler
