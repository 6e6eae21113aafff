"""The tokenize stage: the regenerated conversations into a token store with loss masks
(:mod:`dflash.data.tokenize`)."""

from __future__ import annotations

import json
import logging

from dflash.config.schema import Config
from dflash.data.store import TokenStore
from dflash.data.tokenize import NoSamplesError, Policy, length_summary, tokenize_file, worker_count
from dflash.data.tokenizer import load_tokenizer
from dflash.fileio import atomic_dir, write_json_atomic
from dflash.metrics.schema import TokenizeReport
from dflash.pipeline.workspace import Workspace

logger = logging.getLogger(__name__)


def run(config: Config, workspace: Workspace) -> int:
    """Tokenize ``data/regenerated/conversations.parquet`` into ``data/tokenized``."""
    tokenizer = load_tokenizer(workspace.tokenizer)
    data = config.data
    policy = Policy(
        data.max_seq_len,
        data.overlength,
        config.drafter.min_loss_tokens,
        data.turns,
        dict(data.chat_template_kwargs),
        data.special_tokens_in_content,
    )
    try:
        with atomic_dir(workspace.tokenized) as out:
            manifest = tokenize_file(
                workspace.regenerated_conversations,
                tokenizer,
                out,
                policy,
                data.chunk_size,
                worker_count(data.num_workers),
            )
            report = {**manifest, "length": length_summary(TokenStore(out).lengths)}
            if manifest["n_samples"] == 0:
                raise NoSamplesError(report)
            shown = TokenizeReport.model_validate(report).dump()
            write_json_atomic(out / workspace.tokenize_report.name, shown)
    except NoSamplesError as err:
        logger.error(
            f"no training samples; nothing written. Report:\n{json.dumps(err.report, indent=2)}"
        )
        return 1
    logger.info(
        f"{manifest['n_samples']} samples, {manifest['n_tokens']} tokens "
        f"({manifest['n_loss_tokens']} with loss), truncated {manifest['truncated']}, "
        f"dropped {manifest['dropped']}, assistant turns {manifest['assistant_turns']}, "
        f"special tokens in content {manifest['special_tokens_in_content']}"
    )
    return 0
