"""The openai backend's pieces that need no server: stored messages, failures, params."""

from __future__ import annotations

import httpx
import openai
import pytest

from dflash.data.serving import RETRIED, Endpoints, answer_message, failure_reason
from dflash.errors import ConfigError
from dflash.params import load_config

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
