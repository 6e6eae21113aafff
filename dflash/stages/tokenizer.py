"""The tokenizer stage: train a byte-level BPE on the training split, or adopt
``tokenizer.path``; either way with the drafter's mask token (:mod:`dflash.data.tokenizer`)."""

from __future__ import annotations

import logging

from transformers import AutoTokenizer

from dflash.config.schema import Config
from dflash.data.tokenizer import (
    INFO_FILE,
    add_mask_token,
    corpus_texts,
    tokenizer_hash,
    train_tokenizer,
)
from dflash.fileio import atomic_dir, write_json_atomic
from dflash.pipeline.workspace import Workspace

logger = logging.getLogger(__name__)


def run(config: Config, workspace: Workspace) -> None:
    """Write ``models/tokenizer``: trained on the training split, or ``tokenizer.path``."""
    if config.tokenizer.path is None:
        tokenizer = train_tokenizer(
            corpus_texts(workspace.conversations), config.tokenizer.vocab_size
        )
        source = "trained"
    else:
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer.path, local_files_only=True)
        if not tokenizer.is_fast:
            raise ValueError(f"tokenizer.path = {config.tokenizer.path}: not a fast tokenizer")
        if not tokenizer.chat_template:
            raise ValueError(f"tokenizer.path = {config.tokenizer.path}: has no chat_template")
        source = str(config.tokenizer.path)
    added = add_mask_token(tokenizer, config.drafter.mask_token)
    info = {
        "source": source,
        "mask_token": tokenizer.mask_token,
        "mask_token_id": tokenizer.mask_token_id,
        "mask_token_added": added,
        "vocab_size": len(tokenizer),
        "hash": tokenizer_hash(tokenizer),
    }
    with atomic_dir(workspace.tokenizer) as out:  # no file of a previous tokenizer stays
        tokenizer.save_pretrained(str(out))
        write_json_atomic(out / INFO_FILE, info)
    mask = f"{tokenizer.mask_token} id {tokenizer.mask_token_id}"
    logger.info(f"{source}, {len(tokenizer)} tokens, mask {mask}")
