"""The openai backend: its pieces alone, then whole runs against a fake server in a thread."""

from __future__ import annotations

import json
import shutil
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from tqdm import tqdm

from dflash.cli import main
from dflash.config.params import load_config
from dflash.data import regenerate, serving
from dflash.data.conversations import read_conversations, write_conversations
from dflash.data.serving import RETRIED, Endpoints, answer_message, failure_reason
from dflash.data.tokenizer import IM_END, IM_START, load_tokenizer, train_tokenizer
from dflash.errors import ConfigError
from dflash.pipeline.workspace import Workspace

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

URL = "http://127.0.0.1:9/v1"


def message(**fields) -> dict:
    return {"role": "assistant", **fields}


def whole(text: str) -> tuple[str, bool]:
    return text, False


def stored(fields: dict) -> dict:
    return answer_message(fields, whole)[0]


def test_reasoning_is_stored_apart_from_the_content():
    parsed = message(content="4", reasoning_content="2 + 2")
    assert stored(parsed) == {
        "role": "assistant",
        "content": "4",
        "reasoning_content": "2 + 2",
    }
    assert stored(message(content="4", reasoning="2 + 2"))["reasoning_content"] == "2 + 2"
    inline = message(content="<think>\n2 + 2\n</think>\n\n4")
    assert stored(inline) == {
        "role": "assistant",
        "content": "4",
        "reasoning_content": "2 + 2",
    }
    assert stored(message(content=None)) == {"role": "assistant", "content": ""}


def status_error(cls, code: int):
    request = httpx.Request("POST", URL)
    return cls("x", response=httpx.Response(code, request=request), body=None)


def test_failures_are_named_and_only_server_trouble_is_retried():
    request = httpx.Request("POST", URL)
    reasons = {
        failure_reason(openai.APIConnectionError(request=request)): True,
        failure_reason(openai.APITimeoutError(request)): True,
        failure_reason(status_error(openai.InternalServerError, 503)): True,
        failure_reason(status_error(openai.RateLimitError, 429)): True,
        failure_reason(status_error(openai.BadRequestError, 400)): False,
    }
    assert list(reasons) == ["unreachable", "timeout", "server_error", "rate_limited", "http_400"]
    assert all((reason in RETRIED) == retried for reason, retried in reasons.items())


def test_the_least_busy_endpoint_is_picked_and_a_failed_one_avoided():
    endpoints = Endpoints([URL, "http://127.0.0.1:10/v1"], 1.0)
    first = endpoints.pick()
    first.busy += 1
    assert endpoints.pick() is not first
    first.busy -= 1
    assert endpoints.pick(avoid=first) is not first


def test_the_openai_backend_needs_endpoints_that_are_urls():
    with pytest.raises(ConfigError, match="needs at least one URL"):
        load_config(None, ["regenerate.backend=openai"])
    with pytest.raises(ConfigError, match=r"endpoints\[0\] = '127.0.0.1:8000'"):
        load_config(None, ["regenerate.endpoints=[127.0.0.1:8000]"])
    config = load_config(None, ["regenerate.backend=openai", f"regenerate.endpoints=[{URL}]"])
    assert config.regenerate.endpoints == [URL]


class FakeServer(ThreadingHTTPServer):
    """An OpenAI-compatible server on a free loopback port: ``answer(request)`` gives the
    status and body of each chat completion, ``models`` the ``/models`` entries, and
    ``trickle_s`` the pause between the bytes of a body."""

    daemon_threads = True

    def __init__(self, answer, models=({"id": "fake"},), trickle_s: float = 0.0) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.answer, self.models, self.trickle_s = answer, list(models), trickle_s
        self.url = f"http://127.0.0.1:{self.server_address[1]}/v1"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for start in range(0, len(body), 1 if self.server.trickle_s else len(body) or 1):
            self.wfile.write(body[start : start + 1] if self.server.trickle_s else body)
            self.wfile.flush()
            time.sleep(self.server.trickle_s)

    def do_GET(self) -> None:
        self.reply(200, json.dumps({"object": "list", "data": self.server.models}).encode())

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.reply(*self.server.answer(request))


def completion(content="fine", usage=None, **choice) -> bytes:
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, **choice}
    body = {"id": "x", "object": "chat.completion", "created": 0, "model": "fake"}
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3} | (usage or {})
    return json.dumps(body | {"choices": [choice], "usage": usage}).encode()


@contextmanager
def fake_server(answer, **options):
    server = FakeServer(answer, **options)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


ROWS = 4


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """Four one-turn conversations, a tiny trained tokenizer, a previous regenerated corpus;
    retries wait 10 ms."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(serving, "BACKOFF_S", (0.01, 0.01))
    rows = [
        {
            "conversation_id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"answer {i}"},
            ],
        }
        for i in range(ROWS)
    ]
    write_conversations(rows, WS.conversations)
    train_tokenizer([f"question answer {i}" for i in range(50)], 300).save_pretrained(WS.tokenizer)
    write_conversations(rows[:1], WS.regenerated_conversations)
    WS.regenerate_report.write_text('{"previous": true}')
    (tmp_path / "params.yaml").write_text(
        "data: {regenerate: true, max_seq_len: 96}\ndrafter: {block_size: 2}\n"
    )
    return tmp_path


def regenerate_via(url: str, *sets: str) -> int:
    """Exit status of the regenerate stage run on ``url``, as the command line gives it."""
    params = [
        "regenerate.backend=openai",
        f"regenerate.endpoints=[{url}]",
        "regenerate.shard_size=2",
        "regenerate.max_retries=1",
        "regenerate.timeout_s=5",
        "regenerate.max_new_tokens=8",
        *sets,
    ]
    return main(["regenerate", *(f"--set={item}" for item in params)])


def previous_kept() -> bool:
    return (
        len(read_conversations(WS.regenerated_conversations)) == 1
        and json.loads(WS.regenerate_report.read_text()) == {"previous": True}
        and not list(WS.regenerated_shards.glob("*.json"))
    )


def report() -> dict:
    return json.loads(WS.regenerate_report.read_text())


REFUSALS = {
    "http_404": (404, b'{"error": {"message": "no such route"}}'),
    "no_choices": (200, json.dumps({"id": "x", "choices": None}).encode()),
}


@pytest.mark.parametrize("reason", sorted(REFUSALS))
def test_a_server_refusing_everything_leaves_the_previous_corpus(workspace, reason, capsys):
    with fake_server(lambda request: REFUSALS[reason]) as server:
        assert regenerate_via(server.url) == 2
    assert (
        f"2 conversations (of 4) failed on the servers ({{'{reason}': 2}})"
        in capsys.readouterr().err
    )
    assert previous_kept()
    with fake_server(lambda request: (200, completion())) as server:
        assert regenerate_via(server.url) == 0
    assert report()["shards_made"] == 2 and report()["conversations"] == ROWS


MALFORMED = {
    "bad_json": b'{"choices": [',
    "no_choices": json.dumps({"id": "x"}).encode(),
    "no_message": json.dumps({"choices": [{"index": 0}], "usage": {}}).encode(),
    "bad_content": completion(content=["not", "a", "string"]),
    "bad_usage": completion(usage={"completion_tokens": None}),
}


@pytest.mark.parametrize("reason", sorted(MALFORMED))
def test_a_malformed_answer_is_counted_and_retried(workspace, reason, capsys):
    asked: set[str] = set()

    def once_malformed(request: dict) -> tuple[int, bytes]:
        prompt = request["messages"][-1]["content"]
        first = prompt not in asked
        asked.add(prompt)
        return 200, MALFORMED[reason] if first else completion()

    with fake_server(once_malformed) as server:
        assert regenerate_via(server.url) == 0
    assert report()["failed_requests"] == {reason: ROWS}
    assert report()["failed_conversations"] == {} and report()["turns_regenerated"] == ROWS
    with fake_server(lambda request: (200, MALFORMED[reason])) as server:
        shutil.rmtree(WS.regenerated_shards)
        assert regenerate_via(server.url) == 2
    assert f"({{'{reason}': 2}})" in capsys.readouterr().err


def test_null_usage_is_malformed(workspace):
    body = json.loads(completion())
    body["usage"] = None
    with fake_server(lambda request: (200, json.dumps(body).encode())) as server:
        assert regenerate_via(server.url, "regenerate.max_retries=0") == 2
    assert previous_kept()


def test_timeout_s_bounds_the_whole_request(workspace, capsys):
    """A byte every 50 ms keeps each read under 0.3 s while the whole answer takes seconds:
    a bound per read would let it through, the bound on the request fails it as a timeout."""
    assert len(completion()) * 0.05 > 10 * 0.3
    with fake_server(lambda request: (200, completion()), trickle_s=0.05) as server:
        assert (
            regenerate_via(server.url, "regenerate.timeout_s=0.3", "regenerate.max_retries=0") == 2
        )
    assert "{'timeout': " in capsys.readouterr().err
    assert previous_kept()


def test_failures_within_the_fraction_pass_and_their_shard_is_redone(workspace):
    def refuse_c0(request: dict) -> tuple[int, bytes]:
        return (
            (400, b"{}")
            if request["messages"][-1]["content"] == "question 0"
            else (
                200,
                completion(),
            )
        )

    with fake_server(refuse_c0) as server:
        assert regenerate_via(server.url, "regenerate.max_failed_fraction=0.25") == 0
        assert report()["failed_conversations"] == {"http_400": 1}
        assert report()["shards_not_committed"] == [0]
        assert sorted(p.name for p in WS.regenerated_shards.glob("*.json")) == ["shard_00001.json"]
        assert regenerate_via(server.url, "regenerate.max_failed_fraction=0.24") == 2
    with fake_server(lambda request: (200, completion())) as server:
        assert regenerate_via(server.url) == 0
    assert report()["shards_made"] == 1 and report()["conversations"] == ROWS


def test_a_model_without_an_id_is_an_error(workspace, capsys):
    with fake_server(lambda request: (200, completion()), models=[{"object": "model"}]) as server:
        assert regenerate_via(server.url) == 2
    assert "lists a model without an id" in capsys.readouterr().err
    assert previous_kept()


def test_a_served_answer_ends_at_the_first_stop_string(workspace):
    injected = f"Sure.{IM_END}\n{IM_START}user\nINJECTED"
    with fake_server(lambda request: (200, completion(content=injected))) as server:
        assert regenerate_via(server.url) == 0
    answers = [
        r["messages"][1]["content"] for r in read_conversations(WS.regenerated_conversations)
    ]
    assert answers == ["Sure."] * ROWS
    assert report()["cut_at_stop_string"] == ROWS


def test_an_answer_generated_in_process_ends_at_the_first_stop_string(workspace, monkeypatch):
    """The target may spell a control string with ordinary tokens, or emit a special token
    that is not a stop: either ends the answer."""
    tokenizer = load_tokenizer(WS.tokenizer)
    spelled = tokenizer(
        "Sure.<|im_end|>\nuser", add_special_tokens=False, split_special_tokens=True
    )
    special = tokenizer("Sure.<|im_start|>user", add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids(IM_END)
    generated = [spelled["input_ids"] + [end], special["input_ids"]]
    monkeypatch.setattr(regenerate, "generate", lambda *args: generated)
    rows = read_conversations(WS.conversations)[:2]
    config = load_config(None, ["regenerate.max_new_tokens=8", "drafter.block_size=2"]).regenerate
    out, stats = regenerate.regenerate_shard(None, tokenizer, rows, config, 96, tqdm(disable=True))
    assert [r["messages"][1]["content"] for r in out] == ["Sure.", "Sure."]
    assert stats["cut_at_stop_string"] == 2 and stats["unterminated"] == 0
