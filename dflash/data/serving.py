"""The ``openai`` backend of regenerate: each turn is a chat completion on a serving engine.

Past one GPU, regeneration belongs on engines built for it (vLLM, SGLang, ``transformers
serve``), which batch continuously and run on many devices. This module sends each turn to
their OpenAI-compatible API through the official async client: the conversation so far
(earlier assistant turns already the target's own) and the chat template options, with the
same length cap and temperature as in process. Conversations run concurrently, each on the
least busy endpoint. A transient failure (connection, deadline, 5xx, 429) or a malformed
answer is retried with backoff, on another endpoint when there is one; a refusal (any other
4xx) is not, as it would come back the same. A turn that still fails leaves its conversation
out, counted by reason, and the caller commits no shard that lost one: a rerun redoes it.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import openai
from openai import AsyncOpenAI

from dflash.config.schema import RegenerateConfig
from dflash.errors import ConfigError
from dflash.pipeline.fingerprint import digest

TRANSIENT = ("unreachable", "timeout", "server_error", "rate_limited")
"""Failures of the connection or the server: the same request may well succeed later."""

MALFORMED = ("bad_json", "no_choices", "no_message", "bad_content", "bad_usage")
"""Why a 200 answer is no usable chat completion: a glitch of the server, retried as well."""

RETRIED = TRANSIENT + MALFORMED

HEALTH_TIMEOUT_S = 10.0
"""How long the start-up health check waits for each endpoint's ``/models`` answer."""

BACKOFF_S = (0.5, 8.0)
"""First and longest wait before a retry; the wait doubles on each retry of a turn."""

STABLE_MODEL_KEYS = ("id", "root", "parent", "owned_by", "max_model_len")
"""Keys of a ``/models`` entry that name what is served (``created`` changes every start)."""


class EndpointError(ConfigError):
    """An endpoint is unreachable or serves another model; a run lost turns to failures."""


class Malformed(Exception):
    """A 200 answer that is no chat completion; ``reason`` (one of ``MALFORMED``) names why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Request:
    """What every turn asks the server, fixed for the run."""

    model: str
    max_new_tokens: int
    temperature: float
    max_retries: int
    timeout_s: float
    """Deadline of one request as a whole: a server trickling bytes cannot hold it longer."""
    chat_template_kwargs: dict


@dataclass
class Endpoint:
    url: str
    client: AsyncOpenAI
    busy: int = 0


def client(url: str, timeout_s: float) -> AsyncOpenAI:
    """An async client of ``url`` that never retries on its own: retries are ours."""
    key = os.environ.get("OPENAI_API_KEY") or "none"
    return AsyncOpenAI(base_url=url, api_key=key, timeout=timeout_s, max_retries=0)


class Endpoints:
    """One client per URL; ``pick`` hands out the least busy, ties taken in turn."""

    def __init__(self, urls: list[str], timeout_s: float) -> None:
        self.all = [Endpoint(url, client(url, timeout_s)) for url in urls]
        self.turns: Counter[str] = Counter()
        self.failed_requests: Counter[str] = Counter()
        self._next = 0

    def pick(self, avoid: Endpoint | None = None) -> Endpoint:
        order = self.all[self._next :] + self.all[: self._next]
        self._next = (self._next + 1) % len(self.all)
        return min([e for e in order if e is not avoid] or order, key=lambda e: e.busy)

    async def close(self) -> None:
        for endpoint in self.all:
            await endpoint.client.close()


def failure_reason(err: openai.APIError) -> str:
    """A short name for what went wrong, the key it is counted under."""
    if isinstance(err, openai.APITimeoutError):
        return "timeout"
    if isinstance(err, openai.APIConnectionError):
        return "unreachable"
    if isinstance(err, openai.RateLimitError):
        return "rate_limited"
    if isinstance(err, openai.InternalServerError):
        return "server_error"
    if isinstance(err, openai.APIStatusError):
        return f"http_{err.status_code}"
    return type(err).__name__


@dataclass(frozen=True)
class Completion:
    """The first choice of a chat completion, checked."""

    message: dict
    """``content``, ``reasoning_content`` and ``reasoning``: each a string or None."""
    completion_tokens: int
    finish_reason: str | None


def parse_completion(body: bytes) -> Completion:
    """The first choice of a chat completion's JSON ``body``; raises ``Malformed`` naming
    the first thing missing or of the wrong type."""
    try:
        data = json.loads(body)
    except ValueError:
        raise Malformed("bad_json") from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices:
        raise Malformed("no_choices")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise Malformed("no_message")
    text = {key: message.get(key) for key in ("content", "reasoning_content", "reasoning")}
    if any(value is not None and not isinstance(value, str) for value in text.values()):
        raise Malformed("bad_content")
    usage = data.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if type(tokens) is not int or tokens < 0:
        raise Malformed("bad_usage")
    return Completion(text, tokens, choice.get("finish_reason"))


async def ask(endpoint: Endpoint, messages: list[dict], request: Request, sampling: dict):
    """One request to ``endpoint``, its whole exchange bounded by ``request.timeout_s``."""
    extra = {"chat_template_kwargs": request.chat_template_kwargs}
    async with asyncio.timeout(request.timeout_s):
        raw = await endpoint.client.chat.completions.with_raw_response.create(
            model=request.model,
            messages=messages,
            max_tokens=request.max_new_tokens,
            temperature=request.temperature,
            extra_body=extra if request.chat_template_kwargs else None,
            **sampling,
        )
    return parse_completion(raw.content)


async def complete(
    endpoints: Endpoints, messages: list[dict], request: Request, seed: int, tools: list | None
) -> tuple[Completion | None, str]:
    """The completion answering ``messages`` (with the conversation's ``tools``, as the
    template shows them in the prompt), or None and why it failed at last. Every failed
    request is counted by reason in ``endpoints.failed_requests``."""
    sampling = {"seed": seed} if request.temperature > 0 else {}
    if tools:
        sampling["tools"] = tools
    endpoint, reason = None, ""
    for attempt in range(request.max_retries + 1):
        if attempt:
            await asyncio.sleep(min(BACKOFF_S[0] * 2 ** (attempt - 1), BACKOFF_S[1]))
        endpoint = endpoints.pick(avoid=endpoint)
        endpoint.busy += 1
        try:
            completion = await ask(endpoint, messages, request, sampling)
        except openai.APIError as err:
            reason = failure_reason(err)
        except TimeoutError:
            reason = "timeout"
        except Malformed as err:
            reason = err.reason
        else:
            endpoints.turns[endpoint.url] += 1
            return completion, ""
        finally:
            endpoint.busy -= 1
        endpoints.failed_requests[reason] += 1
        if reason not in RETRIED:
            break
    return None, reason


def answer_message(message: dict, cut: Callable[[str], tuple[str, bool]]) -> tuple[dict, bool]:
    """The assistant message as stored: content, and the reasoning apart when there is some;
    and whether ``cut`` ended it at a stop string (in the reasoning, which comes first, the
    content is dropped).

    Reasoning parsers (vLLM, SGLang) return it as ``reasoning_content`` (newer vLLM:
    ``reasoning``); a server without one leaves ``<think>...</think>`` inline, which is split
    off here as a Qwen3-style template would split it.
    """
    reasoning, stopped = cut(message.get("reasoning_content") or message.get("reasoning") or "")
    content, cut_content = ("", False) if stopped else cut(message.get("content") or "")
    if not reasoning and content.lstrip().startswith("<think>") and "</think>" in content:
        inside, _, content = content.lstrip().removeprefix("<think>").partition("</think>")
        reasoning, content = inside.strip("\n"), content.lstrip("\n")
    answer = {"role": "assistant", "content": content}
    if reasoning:
        answer["reasoning_content"] = reasoning
    return answer, stopped or cut_content


@dataclass(frozen=True)
class Turns:
    """How a shard's conversations are turned into requests: shared by all of them."""

    endpoints: Endpoints
    request: Request
    prompt_length: Callable[[list[dict], list | None], int]
    """Tokens the target sees before answering ``messages`` with ``tools``, as in process."""
    max_seq_len: int
    cut: Callable[[str], tuple[str, bool]]
    """An answer up to its first stop string, and whether it held one, as in process."""
    seed: Callable[[int, int], int]
    """The sampling seed of (row, turn): the same whichever endpoint answers it."""
    progress: object


async def regenerate_row(turns: Turns, k: int, row: dict, answer_at: list[int]):
    """Row ``k`` with its turns ``answer_at`` regenerated one after another, its counts, and
    the reason it failed ('' when it did not)."""
    messages, tools = [dict(m) for m in row["messages"]], row.get("tools")
    counts: Counter[str] = Counter()
    for r, j in enumerate(answer_at):
        if turns.prompt_length(messages[:j], tools) >= turns.max_seq_len:
            counts["outside_window"] += len(answer_at) - r
            turns.progress.update(len(answer_at) - r)
            break
        completion, reason = await complete(
            turns.endpoints, messages[:j], turns.request, turns.seed(k, j), tools
        )
        if completion is None:
            turns.progress.update(len(answer_at) - r)
            return None, counts, reason
        messages[j], cut = answer_message(completion.message, turns.cut)
        counts["turns"] += 1
        counts["tokens_generated"] += completion.completion_tokens
        counts["empty_responses"] += not messages[j]["content"].strip()
        counts["cut_at_stop_string"] += cut
        counts["unterminated"] += not cut and completion.finish_reason == "length"
        turns.progress.update(1)
    return {**row, "messages": messages}, counts, ""


async def regenerate_rows(
    turns: Turns, rows: list[dict], answer_at: list[list[int]], concurrency: int
) -> tuple[list[dict], dict]:
    """Regenerate ``rows`` with at most ``concurrency`` in flight; failed ones are left out,
    counted by reason under ``failed``."""
    limit = asyncio.Semaphore(concurrency)

    async def one(k: int) -> tuple:
        async with limit:
            return await regenerate_row(turns, k, rows[k], answer_at[k])

    try:
        results = await asyncio.gather(*(one(k) for k in range(len(rows))))
    finally:
        await turns.endpoints.close()
    kept, counts, failed = [], Counter(), Counter()
    for row, row_counts, reason in results:
        if row is None:
            failed[reason] += 1
        else:
            kept.append(row)
            counts.update(row_counts)
    return kept, {**counts, "failed": dict(sorted(failed.items()))}


async def listing(url: str) -> list[dict]:
    """The entries of ``url``'s ``/models``, within ``HEALTH_TIMEOUT_S`` in all."""
    async with client(url, HEALTH_TIMEOUT_S) as answer, asyncio.timeout(HEALTH_TIMEOUT_S):
        raw = await answer.models.with_raw_response.list()
    body = json.loads(raw.content)
    entries = body.get("data") if isinstance(body, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"GET /models lists no entries: {raw.text[:200]!r}")
    return entries


def served_model(urls: list[str], model: str | None) -> dict:
    """Health check at start: every endpoint answers ``/models`` and serves ``model``.

    Returns the served identity (the model name and its stable ``/models`` entry), the same on
    every endpoint, which shards are fingerprinted by. Raises ``EndpointError`` otherwise, at
    once: a run never waits on a server that is down or serves another model.
    """

    async def all_listings() -> list:
        return await asyncio.gather(*(listing(url) for url in urls), return_exceptions=True)

    identities = []
    for i, (url, answer) in enumerate(zip(urls, asyncio.run(all_listings()), strict=True)):
        where = f"regenerate.endpoints[{i}] = {url}"
        if isinstance(answer, BaseException):
            raise EndpointError(
                f"{where}: no answer to GET /models ({answer or type(answer).__name__})"
            ) from None
        nameless = [entry for entry in answer if not isinstance(entry.get("id"), str)]
        if nameless:
            raise EndpointError(f"{where}: GET /models lists a model without an id: {nameless[0]}")
        served = {entry["id"]: entry for entry in answer}
        name = model if model is not None else next(iter(served), None)
        if model is None and len(served) != 1:
            raise EndpointError(f"{where} serves {sorted(served)}: set regenerate.model to one")
        if name not in served:
            raise EndpointError(
                f"{where} serves {sorted(served)}, not regenerate.model = {model!r}"
            )
        entry = served[name]
        identities.append(
            {"model": name, "entry": {k: entry[k] for k in STABLE_MODEL_KEYS if k in entry}}
        )
    if any(identity != identities[0] for identity in identities):
        raise EndpointError(f"regenerate.endpoints serve different models: {identities}")
    return identities[0]


def regenerate_shard(
    rows: list[dict],
    answer_at: list[list[int]],
    prompt_length: Callable[[list[dict], list | None], int],
    cut: Callable[[str], tuple[str, bool]],
    config: RegenerateConfig,
    request: Request,
    max_seq_len: int,
    index: int,
    progress,
) -> tuple[list[dict], dict]:
    """Shard ``index`` through the endpoints: the rows kept and their counts, with the turns
    each endpoint answered (``endpoint_turns``). Sampling seeds hang on (seed, shard, row,
    turn), so a resumed run asks what an uninterrupted one would have."""

    def seed(k: int, j: int) -> int:
        return int(digest([config.seed, index, k, j])[:8], 16)

    endpoints = Endpoints(list(config.endpoints), config.timeout_s)
    turns = Turns(endpoints, request, prompt_length, max_seq_len, cut, seed, progress)
    kept, counts = asyncio.run(regenerate_rows(turns, rows, answer_at, config.concurrency))
    return kept, {
        **counts,
        "endpoint_turns": dict(endpoints.turns),
        "failed_requests": dict(sorted(endpoints.failed_requests.items())),
    }
