"""The tokenizer: train a small byte-level BPE, or adopt the target's tokenizer.

Either way the result is a Hugging Face tokenizer directory with a chat template and the
``<|MASK|>`` token the drafter fills its blocks with. A small ``dflash_tokenizer.json``
beside it records where it came from and whether ``<|MASK|>`` had to be added, because an
added token changes the vocabulary the target's embedding must cover.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from dflash.data.conversations import ROW_GROUP, iter_batches
from dflash.pipeline.fingerprint import digest

logger = logging.getLogger(__name__)

MASK_TOKEN = "<|MASK|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
INFO_FILE = "dflash_tokenizer.json"
"""In a tokenizer directory: where it came from, its mask token and its hash."""
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, MASK_TOKEN]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') -}}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set arguments = call['function']['arguments'] -%}"
    "{{- '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' -}}"
    "{{- (arguments if arguments is string else arguments | tojson) + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)
"""ChatML, the format Qwen-family targets serve, so a default run tokenizes like a real one.

Tool calls render as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` after the
content, as Qwen's templates do; tool results are turns of role ``tool``."""


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts``, streamed: the trainer keeps word counts only.

    Byte-level, so any string encodes and no unknown token is needed.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, MASK_TOKEN],
        mask_token=MASK_TOKEN,
        model_max_length=1 << 30,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def add_mask_token(tokenizer: PreTrainedTokenizerFast, existing: str | None = None) -> bool:
    """Set the token the drafter fills blocks with as ``tokenizer.mask_token``.

    ``existing`` names a token already in the vocabulary (a reserved special token of a target
    with no spare embedding rows, e.g. Llama-3.1's 128,256 tokens for 128,256 rows); otherwise
    ``<|MASK|>`` is used, appended when missing. True when a token had to be added.
    """
    if existing is not None:
        taken = {tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token, IM_END}
        if existing not in tokenizer.get_vocab() or existing in taken:
            raise ValueError(
                f"drafter.mask_token = {existing!r}: must be a token of the tokenizer that never "
                "appears in text (a reserved special token), not end-of-turn, padding or bos"
            )
        tokenizer.mask_token = existing
        return False
    added = MASK_TOKEN not in tokenizer.get_vocab()
    if added:
        tokenizer.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
    tokenizer.mask_token = MASK_TOKEN
    return added


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a fast tokenizer directory; without a mask token, ``<|MASK|>`` is set (added and
    reported if missing). The tokenizer stage saves the one it chose as ``mask_token``."""
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not tokenizer.is_fast:
        raise ValueError(f"tokenizer at {path} is not a fast tokenizer: offsets are needed")
    if tokenizer.mask_token is None and add_mask_token(tokenizer):
        logger.warning(f"tokenizer at {path}: added special token {MASK_TOKEN}")
    return tokenizer


def tokenizer_hash(tokenizer: PreTrainedTokenizerFast) -> str:
    """Fingerprint of everything that decides token ids: vocabulary, rules, chat template.

    Truncation and padding are left out: they are call settings a tokenizer call changes.
    """
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    state.pop("truncation", None)
    state.pop("padding", None)
    state["chat_template"] = tokenizer.chat_template
    return digest(state)


def corpus_texts(path: str | Path) -> Iterator[str]:
    """The text a BPE learns from, read one row group at a time: never the whole file.

    Message contents, reasoning and tool calls; template markup is special tokens and not
    learned.
    Strings, not lists of them: the trainer reads a few hundred items ahead, and a few
    hundred row groups would be the whole corpus again.
    """
    for batch in iter_batches(path, ROW_GROUP):
        messages = batch.column("messages").flatten()
        calls = messages.field("tool_calls").flatten().field("function")
        yield from messages.field("content").drop_null().to_pylist()
        yield from messages.field("reasoning_content").drop_null().to_pylist()
        yield from calls.field("name").to_pylist()
        yield from calls.field("arguments").to_pylist()


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """End-of-turn tokens: ``<|im_end|>`` when the vocabulary has it, and the eos token."""
    ids = {tokenizer.eos_token_id}
    if IM_END in tokenizer.get_vocab():
        ids.add(tokenizer.convert_tokens_to_ids(IM_END))
    return sorted(i for i in ids if i is not None)
