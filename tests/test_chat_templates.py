"""Real targets' chat templates (committed text fixtures), tiny vocabularies built in code.

For Qwen3 (thinking), Llama-3.1 (tool calls, ``<|eot_id|>``) and Mistral v0.3 (``[TOOL_CALLS]``
with call ids): what is learned is exactly the assistant outputs the policy says, reasoning
and end-of-turn token included, and never user, system, tool-result or tool-schema text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dflash.data.chat import encode_chats, template_renderer
from dflash.data.records import parse_record

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
TARGETS = {
    "qwen3": {
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "plain": ["<think>", "</think>", "<tool_call>", "</tool_call>"],
        "bos": None,
        "eos": "<|im_end|>",
    },
    "llama3.1": {
        "special": [
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
        "plain": [],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
    },
    "mistral-v0.3": {
        "special": [
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        "plain": [],
        "bos": "<s>",
        "eos": "</s>",
    },
}


def tiny_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """Bytes plus the target's special tokens: every character boundary is a token boundary."""
    spec = TARGETS[name]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1,
        special_tokens=spec["special"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["a"], trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["plain"]])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=spec["bos"], eos_token=spec["eos"]
    )
    fast.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return fast


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request) -> tuple[str, PreTrainedTokenizerFast]:
    return request.param, tiny_tokenizer(request.param)


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL_RECORD = {
    "tools": [WEATHER],
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call00001",
                    "type": "function",
                    "function": {"name": "weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call00001", "name": "weather", "content": "3 degrees"},
        {"role": "assistant", "content": "It is 3 degrees."},
    ],
}
REASONING_RECORD = {
    "messages": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "reasoning": "Add two and two.", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nAdd three and three.\n</think>\n\n6."},
    ]
}
NEVER_LEARNED = ["You are terse", "Weather in Oslo", '3 degrees"', "Current weather", "2+2", "3+3"]


def learned(tokenizer, encoded) -> list[str]:
    """The learned text of each sample, and the text before its first learned token."""
    return [tokenizer.decode(ids[mask == 1].tolist()) for ids, mask in encoded]


def prompt_part(tokenizer, ids: np.ndarray, mask: np.ndarray) -> str:
    return tokenizer.decode(ids[: int(np.argmax(mask))].tolist())


def served_outputs(tokenizer, chat: dict, **options) -> list[str]:
    """Each assistant turn's output as Hugging Face renders it: the reference, independent of
    dflash's renderer."""
    messages, outputs = chat["messages"], []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        render = tokenizer.apply_chat_template
        prompt = render(messages[:i], tools=chat.get("tools"), add_generation_prompt=True,
                        tokenize=False, **options)  # fmt: skip
        full = render(messages[: i + 1], tools=chat.get("tools"), tokenize=False, **options)
        assert full.startswith(prompt)
        outputs.append(full[len(prompt) :].rstrip())
    return outputs


def test_rendering_is_what_apply_chat_template_renders(target):
    name, tokenizer = target
    for record in (TOOL_RECORD, REASONING_RECORD):
        chat = parse_record(record)
        for options in ({}, {"enable_thinking": False}):
            render = template_renderer(tokenizer, options)
            for gen in (False, True):
                ours = render(
                    chat["messages"][:-1], add_generation_prompt=gen, tools=chat.get("tools")
                )
                theirs = tokenizer.apply_chat_template(
                    chat["messages"][:-1],
                    tools=chat.get("tools"),
                    add_generation_prompt=gen,
                    tokenize=False,
                    **options,
                )
                assert ours == theirs, name


def test_per_turn_learns_each_served_output_with_its_end_token(target):
    name, tokenizer = target
    chat = parse_record(TOOL_RECORD)
    [(encoded, plan)] = encode_chats(tokenizer, [chat], "per_turn")
    assert plan.skipped == [] and plan.learned == 2 and len(encoded) == 2
    texts = learned(tokenizer, encoded)
    if name != "mistral-v0.3":  # its prompt is rewritten once answered: see the next test
        assert texts == served_outputs(tokenizer, chat)
    assert all(text.endswith(TARGETS[name]["eos"]) for text in texts)
    assert "weather" in texts[0] and texts[1].endswith(f"It is 3 degrees.{TARGETS[name]['eos']}")
    for text in texts:
        assert not any(word in text for word in NEVER_LEARNED)
    for ids, mask in encoded:
        assert "Current weather of a city" in prompt_part(tokenizer, ids, mask)


def test_call_ids_reach_the_templates_that_render_them():
    """Mistral v0.3 puts the system prompt into the last user message only, so a turn's prompt
    is not a prefix of the chat that answers it: the output is found after the prompt's tail."""
    tokenizer = tiny_tokenizer("mistral-v0.3")
    [(encoded, _)] = encode_chats(tokenizer, [parse_record(TOOL_RECORD)], "per_turn")
    call, answer = learned(tokenizer, encoded)
    assert call.startswith("[TOOL_CALLS] [") and '"id": "call00001"}]</s>' in call
    assert answer == " It is 3 degrees.</s>"
    ids, mask = encoded[1]
    prompt = prompt_part(tokenizer, ids, mask)
    assert '"call_id": "call00001"}[/TOOL_RESULTS]' in prompt and "[AVAILABLE_TOOLS]" in prompt
    ids, mask = encoded[0]
    assert prompt_part(tokenizer, ids, mask).endswith(
        "[INST] You are terse.\n\nWeather in Oslo?[/INST]"
    )


def test_qwen3_reasoning_is_learned_per_turn_and_only_where_shown_per_conversation():
    tokenizer = tiny_tokenizer("qwen3")
    chat = parse_record(REASONING_RECORD)
    first = "<think>\nAdd two and two.\n</think>\n\n4.<|im_end|>"
    second = "<think>\nAdd three and three.\n</think>\n\n6.<|im_end|>"
    [(encoded, plan)] = encode_chats(tokenizer, [chat], "per_turn")
    assert learned(tokenizer, encoded) == [first, second] and plan.learned == 2
    # The second sample's history shows the first answer without its reasoning, as served.
    ids, mask = encoded[1]
    assert "<|im_start|>assistant\n4.<|im_end|>" in prompt_part(tokenizer, ids, mask)
    [(encoded, plan)] = encode_chats(tokenizer, [chat], "per_conversation")
    assert learned(tokenizer, encoded) == [second]
    assert plan.skipped == [(1, "not_shown_in_full")] and plan.learned == 1


def test_qwen3_thinking_off_puts_the_empty_think_block_in_the_prompt():
    tokenizer = tiny_tokenizer("qwen3")
    chat = {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo."}]
    }
    off = {"enable_thinking": False}
    for turns in ("per_turn", "per_conversation"):
        [(encoded, plan)] = encode_chats(tokenizer, [chat], turns, off)
        [(ids, mask)] = encoded
        assert learned(tokenizer, encoded) == ["Yo.<|im_end|>"]
        assert prompt_part(tokenizer, ids, mask).endswith("assistant\n<think>\n\n</think>\n\n")
    [(encoded, plan)] = encode_chats(tokenizer, [parse_record(REASONING_RECORD)], "per_turn", off)
    assert encoded == [] and plan.skipped == [
        (1, "prompt_not_continued"),
        (3, "prompt_not_continued"),
    ]


def test_a_turn_the_template_rejects_is_counted_not_raised():
    tokenizer = tiny_tokenizer("mistral-v0.3")
    chat = parse_record(TOOL_RECORD)
    del chat["messages"][2]["tool_calls"][0]["id"]  # Mistral requires 9-character call ids
    for turns in ("per_turn", "per_conversation"):
        [(encoded, plan)] = encode_chats(tokenizer, [chat], turns)
        assert (2, "template_error") in plan.skipped
        assert all(not any(w in t for w in NEVER_LEARNED) for t in learned(tokenizer, encoded))


def test_qwen3_thinking_off_finds_a_call_whose_markup_shares_a_prefix_with_think():
    """``<tool_call>`` and the prompt's ``<think>`` share "<t": the search starts at the turn."""
    tokenizer = tiny_tokenizer("qwen3")
    chat = parse_record({**TOOL_RECORD, "messages": TOOL_RECORD["messages"][1:]})
    [(encoded, plan)] = encode_chats(
        tokenizer, [chat], "per_conversation", {"enable_thinking": False}
    )
    assert plan.skipped == [] and plan.learned == 2
    call, answer = learned(tokenizer, encoded)[0].split("<|im_end|>")[:2]
    assert call.startswith("<tool_call>\n") and answer == "It is 3 degrees."


THINKING_CHAIN = {
    "tools": [WEATHER],
    "messages": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "reasoning": "Add two and two.", "content": "4."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "reasoning": "Ask the weather tool.",
            "content": "",
            "tool_calls": [
                {
                    "id": "call00001",
                    "type": "function",
                    "function": {"name": "weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call00001", "name": "weather", "content": "3 degrees"},
        {"role": "assistant", "reasoning": "Report it.", "content": "It is 3 degrees."},
    ],
}


def test_auto_learns_every_turn_as_served_in_one_sample_per_user_query():
    """Qwen3 drops reasoning before the last user query: the first query's answer gets its
    own sample, the second query's tool chain stays one sample, every turn as per_turn."""
    tokenizer = tiny_tokenizer("qwen3")
    chat = parse_record(THINKING_CHAIN)
    [(per_turn, _)] = encode_chats(tokenizer, [chat], "per_turn")
    [(encoded, plan)] = encode_chats(tokenizer, [chat], "auto")
    assert plan.skipped == [] and plan.learned == 3 and len(encoded) == 2
    first, chain = learned(tokenizer, encoded)
    assert [first] == learned(tokenizer, per_turn[:1])
    assert first == "<think>\nAdd two and two.\n</think>\n\n4.<|im_end|>"
    assert chain == "".join(learned(tokenizer, per_turn[1:]))
    assert "Ask the weather tool." in chain and chain.endswith("It is 3 degrees.<|im_end|>")
    # The chain's sample is the whole chat: its history shows the first answer as served.
    ids, mask = encoded[1]
    assert "<|im_start|>assistant\n4.<|im_end|>" in prompt_part(tokenizer, ids, mask)
    assert sum(len(ids) for ids, _ in encoded) < sum(len(ids) for ids, _ in per_turn)
    for text in (first, chain):
        assert not any(word in text for word in NEVER_LEARNED)


def test_auto_is_the_whole_conversation_when_the_template_shows_every_turn(target):
    """A tool chain after one query, and for templates that keep history any chat: one
    sample, the very one per_conversation makes. (Qwen3 shows a chain's steps as served when
    each has its reasoning: a step served with an empty think block loses it in history.)"""
    name, tokenizer = target
    chain = {**THINKING_CHAIN, "messages": THINKING_CHAIN["messages"][2:]}
    records = [chain] if name == "qwen3" else [TOOL_RECORD, REASONING_RECORD, THINKING_CHAIN]
    chats = [parse_record(record) for record in records]
    auto = encode_chats(tokenizer, chats, "auto")
    whole = encode_chats(tokenizer, chats, "per_conversation")
    for (encoded, plan), (expected, reference) in zip(auto, whole, strict=True):
        assert len(encoded) == 1 and plan.learned == reference.learned >= 2
        assert plan.skipped == reference.skipped == []
        for (ids, mask), (ids_, mask_) in zip(encoded, expected, strict=True):
            assert np.array_equal(ids, ids_) and np.array_equal(mask, mask_)


def test_auto_keeps_turns_truncation_cuts_cut():
    """A turn past the cut of the whole chat gets no sample of its own: any sample holding
    it would be cut there too. A hidden turn before the cut still gets its sample."""
    tokenizer = tiny_tokenizer("qwen3")
    chat = parse_record(THINKING_CHAIN)
    [([(first_ids, _), _], _)] = encode_chats(tokenizer, [chat], "auto")
    cut = len(first_ids) - 10  # inside the first answer; the chain starts later in the chat
    [(encoded, plan)] = encode_chats(tokenizer, [chat], "auto", max_tokens=cut)
    assert plan.learned == 1 and plan.skipped == [] and len(encoded) == 1
    [(ids, mask)] = encoded
    assert np.array_equal(ids, first_ids[:cut])
    assert learned(tokenizer, encoded)[0].startswith("<think>\nAdd two")
