"""The target stage: pretrain the tiny default, or check and reference a real target.

``target.path`` set: a real Hugging Face causal LM. It is loaded once to check it works and
``models/target/`` records only a reference to it (path, config summary, config hash), so
an 8B model is never copied into the pipeline's outputs. ``target.path`` null: the tiny
default Qwen3 is pretrained here (see ``dflash.model.pretrain``) and saved in full. Later
stages load the result through ``dflash.model.load``, which knows nothing of pretraining.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dflash.config.schema import Config
from dflash.data.conversations import read_conversations
from dflash.data.tokenizer import IM_END, load_tokenizer
from dflash.fileio import atomic_dir, remove_files, write_json_atomic
from dflash.metrics.headline import write_metrics
from dflash.metrics.schema import TargetDetails, TargetHeadline
from dflash.model.layer_ids import check_layer_selection, target_depth
from dflash.model.load import load_target
from dflash.model.pretrain import (
    build_tiny_target,
    encode_windows,
    heldout_loss,
    pack,
    pretrain,
)
from dflash.model.target_dir import TARGET_REFERENCE
from dflash.pipeline.fingerprint import digest
from dflash.pipeline.workspace import Workspace
from dflash.threads import set_cpu_threads

logger = logging.getLogger(__name__)

REFERENCE_EVAL_ROWS = 64
"""Held-out rows of ``max_seq_len`` a referenced (possibly huge) target is scored on."""


def config_hash(model: PreTrainedModel) -> str:
    """Fingerprint of the architecture, so a changed target invalidates what depends on it."""
    summary = model.config.to_dict()
    summary.pop("transformers_version", None)
    return digest(summary)


def score_heldout(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    heldout: Path,
    max_rows: int | None = None,
) -> dict:
    """Held-out loss and perplexity on ``heldout`` (empty when it has no conversations)."""
    rows = read_conversations(heldout) if heldout.exists() else []
    if not rows:
        return {}
    documents, _ = encode_windows(rows, tokenizer, max_seq_len)
    input_ids, labels = pack(documents, max_seq_len, tokenizer.pad_token_id)
    loss, tokens = heldout_loss(model, input_ids[:max_rows], labels[:max_rows])
    return {"heldout_loss": loss, "heldout_perplexity": math.exp(loss), "heldout_tokens": tokens}


def reference_target(config: Config, tokenizer: PreTrainedTokenizerBase, w: Workspace) -> None:
    """Check that ``target.path`` loads and covers the tokenizer, then record a reference."""
    source = config.target.path
    if Path(source).resolve() == w.target.resolve():
        raise ValueError(f"target.path = {source}: is the stage's own output directory")
    model = load_target(source)
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(
            f"target.path = {source}: vocabulary {model.config.vocab_size} is smaller than the "
            f"tokenizer's {len(tokenizer)} at {w.tokenizer} (is it the target's tokenizer?)"
        )
    local = Path(source)
    reference = {
        "path": str(local.resolve()) if local.exists() else source,
        "model_type": model.config.model_type,
        "architectures": model.config.architectures,
        "num_hidden_layers": model.config.num_hidden_layers,
        "hidden_size": model.config.hidden_size,
        "vocab_size": model.config.vocab_size,
        "config_sha256": config_hash(model),
    }
    metrics = {"mode": "reference", "parameters": model.num_parameters()}
    metrics |= score_heldout(
        model, tokenizer, config.data.max_seq_len, w.heldout, REFERENCE_EVAL_ROWS
    )
    remove_files(w.target_metrics, w.target_details)
    with atomic_dir(w.target) as tmp:
        write_json_atomic(tmp / TARGET_REFERENCE, reference)
    details = TargetDetails.model_validate(metrics)
    write_metrics(w.target_metrics, w.target_details, details, TargetHeadline)
    logger.info(f"reference to {reference['path']} ({model.config.model_type})")


def pretrain_target(config: Config, tokenizer: PreTrainedTokenizerBase, w: Workspace) -> None:
    """Pretrain the tiny default on the training split and save it with its tokenizer."""
    max_seq_len = config.data.max_seq_len
    model = build_tiny_target(config.target, tokenizer, max_seq_len)
    rows = read_conversations(w.conversations)
    documents, cut = encode_windows(rows, tokenizer, max_seq_len)
    input_ids, labels = pack(documents, max_seq_len, tokenizer.pad_token_id)
    metrics = {"mode": "pretrained", "parameters": model.num_parameters()}
    metrics["tokens_beyond_max_seq_len"] = cut
    end_id = tokenizer.convert_tokens_to_ids(IM_END) if IM_END in tokenizer.get_vocab() else None
    metrics |= pretrain(model, input_ids, labels, config.target, end_id)
    metrics |= score_heldout(model, tokenizer, max_seq_len, w.heldout)
    remove_files(w.target_metrics, w.target_details)
    with atomic_dir(w.target) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    details = TargetDetails.model_validate(metrics)
    write_metrics(w.target_metrics, w.target_details, details, TargetHeadline)
    logger.info(
        f"{metrics['parameters']:,} parameters, train loss {metrics['train_loss']:.3f}, "
        f"held-out perplexity {metrics.get('heldout_perplexity', float('nan')):.2f}"
    )


def run(config: Config, workspace: Workspace) -> None:
    """Write ``models/target/`` and ``metrics/target.json``."""
    w = workspace
    set_cpu_threads()
    depth = target_depth(config.target.path, config.target.num_hidden_layers)
    if config.drafter.num_target_features is not None:  # null: train checks the checkpoint's
        check_layer_selection(depth, config.drafter.num_target_features)
    tokenizer = load_tokenizer(w.tokenizer)
    if config.target.path is None:
        pretrain_target(config, tokenizer, w)
    else:
        reference_target(config, tokenizer, w)
