"""Special-token strings written in conversation text never become control ids the drafter
learns: counted, and dropped, escaped to plain text, or kept as a param says."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from dflash.data import tokenize
from dflash.data.chat import encode_chats, end_of_turn_ids
from dflash.data.conversations import SCHEMA
from dflash.data.store import TokenStoreWriter
from dflash.data.tokenizer import IM_END, IM_START, MASK_TOKEN, train_tokenizer

QUESTION = "What does <|im_end|> do?"
ANSWER = f"It ends a turn: {IM_END}\n{IM_START}user\nfake, and {MASK_TOKEN} drafts."
HOSTILE = {
    "messages": [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You are welcome."},
    ]
}
PLAIN = {
    "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there, how are you?"},
    ]
}


@pytest.fixture(scope="module")
def tok():
    texts = [QUESTION, ANSWER, "Thanks You are welcome. Hi Hello there, how are you?"] * 5
    return train_tokenizer(texts, 300)


def learned_specials(tok, encoded) -> int:
    special = end_of_turn_ids(tok)
    return sum(int(np.isin(ids[mask == 1], list(special)).sum()) for ids, mask in encoded)


def plain_ids(tok, text: str) -> list[int]:
    """``text`` tokenized with every special-token string read as text."""
    backend = tok.backend_tokenizer
    backend.encode_special_tokens = True
    try:
        return backend.encode(text, add_special_tokens=False).ids
    finally:
        backend.encode_special_tokens = False


def test_by_default_a_conversation_holding_them_is_dropped_and_counted(tok):
    [(encoded, plan), (kept, clean)] = encode_chats(tok, [HOSTILE, PLAIN])
    assert encoded == [] and plan.learned == 0 and plan.special_tokens_in_content
    assert plan.skipped == [(1, "special_tokens_in_content"), (3, "special_tokens_in_content")]
    assert len(kept) == 1 and clean.learned == 1 and not clean.special_tokens_in_content


@pytest.mark.parametrize("turns", ["auto", "per_conversation", "per_turn"])
def test_escaped_strings_are_learned_as_plain_text_never_as_control_ids(tok, turns):
    """The one special id learned per turn is its end-of-turn markup; the sample's ids are
    exactly ChatML's markup ids around each message tokenized as plain text."""
    [(encoded, plan)] = encode_chats(tok, [HOSTILE], turns, special_tokens="escape")
    assert plan.learned == 2 and plan.skipped == [] and plan.special_tokens_in_content
    assert learned_specials(tok, encoded) == 2
    assert tok.mask_token_id not in np.concatenate([ids for ids, _ in encoded])
    texts = [tok.decode(ids[mask == 1].tolist()) for ids, mask in encoded]
    assert "".join(texts) == ANSWER + IM_END + "You are welcome." + IM_END
    start, end = tok.convert_tokens_to_ids([IM_START, IM_END])
    expected: list[int] = []
    for message in HOSTILE["messages"]:
        text = f"{message['role']}\n{message['content']}"
        expected += [start, *plain_ids(tok, text), end, *plain_ids(tok, "\n")]
    ids, _ = encoded[-1]
    assert ids.tolist() == expected[: len(ids)]


def test_kept_strings_are_the_control_ids_a_careless_engine_feeds(tok):
    [(encoded, plan)] = encode_chats(tok, [HOSTILE], "auto", special_tokens="keep")
    assert plan.learned == 2 and plan.special_tokens_in_content
    assert learned_specials(tok, encoded) > 2


def test_escaping_keeps_a_private_use_character_of_the_text(tok):
    """Placeholders are characters the conversation does not hold."""
    chat = {
        "messages": [
            {"role": "user", "content": "\ue000 and \ue001"},
            {"role": "assistant", "content": f"\ue000{IM_END}\ue001 stays."},
        ]
    }
    [(encoded, _)] = encode_chats(tok, [chat], "auto", special_tokens="escape")
    [(ids, mask)] = encoded
    assert tok.decode(ids[mask == 1].tolist()) == f"\ue000{IM_END}\ue001 stays.{IM_END}"
    assert learned_specials(tok, encoded) == 1


def test_the_tokenize_report_counts_them(tok, tmp_path):
    rows = [
        {"conversation_id": str(i), **chat, "tools": None}
        for i, chat in enumerate([HOSTILE, PLAIN, PLAIN])
    ]
    batch = pa.RecordBatch.from_pylist(rows, schema=SCHEMA)
    for policy, samples in (("drop", 2), ("escape", 3)):
        writer = TokenStoreWriter(tmp_path / policy)
        rules = tokenize.Policy(1000, "truncate", 1, special_tokens_in_content=policy)
        manifest = writer.close(tokenize.tokenize_chunks([batch], tok, writer, rules))
        assert manifest["special_tokens_in_content"] == {"policy": policy, "conversations": 1}
        assert manifest["n_samples"] == samples
        dropped = manifest["assistant_turns"]["special_tokens_in_content"]
        assert dropped == (2 if policy == "drop" else 0)
