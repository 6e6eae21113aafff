"""The regenerate stage: every assistant turn of the training split answered by the target.

In process (``model.generate``, :mod:`dflash.model.load`) or by serving engines
(:mod:`dflash.data.serving`), shard by shard (:mod:`dflash.data.regenerate`), each shard
fingerprinted by what its content depends on so an interrupted run resumes.
"""

from __future__ import annotations

import logging
import shutil
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from dflash.config.schema import Config
from dflash.data.conversations import count_conversations, read_conversations, write_conversations
from dflash.data.regenerate import (
    COUNTS,
    Backend,
    answer_turns,
    regenerate_shard,
    served,
    shard_of,
)
from dflash.data.tokenizer import load_tokenizer
from dflash.fileio import atomic_path, remove_files
from dflash.metrics.headline import write_metrics
from dflash.metrics.schema import RegenerateHeadline, RegenerateReport
from dflash.model.load import load_target, target_device_dtype
from dflash.pipeline.closure import declared_inputs
from dflash.pipeline.fingerprint import digest, path_digest
from dflash.pipeline.workspace import Workspace
from dflash.progress import progress_bar
from dflash.threads import set_cpu_threads

logger = logging.getLogger(__name__)


def fingerprint(config: Config, engine: dict, w: Workspace) -> str:
    """What a shard's content depends on: the params the stage declares (its knobs say where
    and how hard servers are asked, not what they answer), the engine (the device in process,
    the served model's identity through openai), target, tokenizer, input data, code."""
    parts = declared_inputs(config, "regenerate") | {
        "engine": engine,
        "target": path_digest(w.target),
        "tokenizer": path_digest(w.tokenizer),
        "conversations": path_digest(w.conversations),
    }
    return digest(parts)[:16]


def in_process(
    config: Config, tokenizer: PreTrainedTokenizerBase, target: Path
) -> tuple[Backend, dict]:
    """``model.generate`` here, seeded per shard so a resumed run samples what an
    uninterrupted one would have; the engine is the device."""
    device, _ = target_device_dtype()
    model = load_target(target, device)
    options = dict(config.data.chat_template_kwargs)

    def answer(rows: list[dict], index: int, progress: tqdm) -> tuple[list[dict], dict]:
        torch.manual_seed(config.regenerate.seed + index)
        return regenerate_shard(
            model, tokenizer, rows, config.regenerate, config.data.max_seq_len, progress, options
        )

    return answer, {"device": device.type}


def regenerate(config: Config, w: Workspace) -> dict:
    """Regenerate the training split shard by shard; return the report."""
    size = config.regenerate.shard_size
    tokenizer = load_tokenizer(w.tokenizer)
    if config.regenerate.backend == "openai":
        answer, engine = served(config, tokenizer, dict(config.data.chat_template_kwargs))
    else:
        answer, engine = in_process(config, tokenizer, w.target)
    rows = read_conversations(w.conversations)
    fp = fingerprint(config, engine, w)
    allowed = config.regenerate.max_failed_fraction * len(rows)
    totals = dict.fromkeys(COUNTS, 0)
    failed: Counter[str] = Counter()
    served_by: Counter[str] = Counter()
    failed_requests: Counter[str] = Counter()
    lost: list[int] = []
    fresh = {"shards": 0, "conversations": 0, "tokens_generated": 0, "seconds": 0.0}
    output: list[dict] = []
    turns = sum(len(answer_turns(r["messages"])) for r in rows)
    progress = progress_bar(total=turns, desc="regenerate", unit="turn")
    starts = range(0, len(rows), size)
    for index, start in enumerate(starts):
        shard, stats, made = shard_of(
            w.regenerated_shards, index, rows[start : start + size], fp, answer, progress
        )
        output.extend(shard)
        totals = {key: totals[key] + stats[key] for key in COUNTS}
        failed.update(stats.get("failed", {}))
        if stats.get("failed"):
            lost.append(index)
            if failed.total() > allowed:
                break
        if made:
            fresh["shards"] += 1
            fresh["conversations"] += len(shard)
            fresh["tokens_generated"] += stats["tokens_generated"]
            fresh["seconds"] += stats["seconds"]
            served_by.update(stats.get("endpoint_turns", {}))
            failed_requests.update(stats.get("failed_requests", {}))
    progress.close()
    if failed.total() > allowed:
        raise regeneration_lost(
            lost, failed, len(rows), config.regenerate.max_failed_fraction, w.regenerated
        )
    remove_files(w.regenerate_metrics, w.regenerate_report)
    write_conversations(output, w.regenerated_conversations)
    seconds = fresh["seconds"]
    return {
        "skipped": False,
        "conversations": len(output),
        "turns_regenerated": totals["turns"],
        "turns_outside_window": totals["outside_window"],
        "tokens_generated": totals["tokens_generated"],
        "empty_responses": totals["empty_responses"],
        "unterminated_responses": totals["unterminated"],
        "cut_at_stop_string": totals["cut_at_stop_string"],
        "shards": len(starts),
        "shards_made": fresh["shards"],
        "failed_conversations": dict(sorted(failed.items())),
        "shards_not_committed": lost,
        "fingerprint": fp,
        "engine": engine,
        "endpoint_turns": dict(sorted(served_by.items())),
        "failed_requests": dict(sorted(failed_requests.items())),
        "seconds": seconds,
        "tokens_per_s": fresh["tokens_generated"] / seconds if seconds else None,
        "conversations_per_s": fresh["conversations"] / seconds if seconds else None,
    }


def regeneration_lost(
    shards: list[int], failed: Counter, total: int, fraction: float, regenerated: Path
):
    """The error a run ends with when servers failed too many conversations: the user fixes
    them and reruns, which redoes only the shards not committed."""
    from dflash.data.serving import EndpointError

    return EndpointError(
        f"regenerate: {failed.total()} conversations (of {total}) failed on the servers "
        f"({dict(sorted(failed.items()))}), more than regenerate.max_failed_fraction = "
        f"{fraction} allows (the run stops there); shards {shards} were not committed and "
        f"the previous {regenerated} is left in place: rerun to retry them"
    )


def copy_conversations(w: Workspace) -> dict:
    """``data.regenerate: false``: the training split passes through unchanged.

    A byte copy in the file system's own chunks: memory does not grow with the corpus."""
    remove_files(w.regenerate_metrics, w.regenerate_report)
    with atomic_path(w.regenerated_conversations) as tmp:
        shutil.copyfile(w.conversations, tmp)
    return {"skipped": True, "conversations": count_conversations(w.conversations)}


def run(config: Config, workspace: Workspace) -> None:
    """Write ``data/regenerated/conversations.parquet`` and ``data/regenerated/report.json``."""
    w = workspace
    set_cpu_threads()
    # The report is written last and marks a finished run: it is removed just before the
    # conversations are replaced, so a run that dies leaves none beside new conversations.
    report = regenerate(config, w) if config.data.regenerate else copy_conversations(w)
    details = RegenerateReport.model_validate(report)
    write_metrics(w.regenerate_metrics, w.regenerate_report, details, RegenerateHeadline)
    if report["skipped"]:
        logger.info(f"skipped, copied {report['conversations']} conversations")
    else:
        logger.info(
            f"{report['turns_regenerated']} turns of {report['conversations']} "
            f"conversations, {report['tokens_generated']} tokens"
        )
