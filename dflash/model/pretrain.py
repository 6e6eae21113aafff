"""Build and pretrain the tiny default target: a small Qwen3 causal LM, trained from scratch.

DFlash needs a target to draft for. Without a real one, a Qwen3-architecture model a few
layers deep is trained here on the chat-formatted training split with plain next-token
loss, so the pipeline runs end to end on a CPU in minutes and the target's greedy output
still looks like its corpus (which is what the drafter learns to predict).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

from dflash.config.schema import TargetConfig
from dflash.progress import progress_bar

IGNORE = -100
"""Label of positions that carry no loss (padding of the last packed row)."""


def build_tiny_target(
    config: TargetConfig, tokenizer: PreTrainedTokenizerBase, max_seq_len: int
) -> Qwen3ForCausalLM:
    """A freshly initialised Qwen3 sized by ``config``, over the tokenizer's full vocabulary."""
    torch.manual_seed(config.seed)
    model_config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        max_position_embeddings=max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = Qwen3ForCausalLM(model_config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.do_sample = False
    return model


def encode_windows(
    rows: list[dict], tokenizer: PreTrainedTokenizerBase, max_seq_len: int
) -> tuple[list[list[int]], int]:
    """Each conversation's first ``max_seq_len`` chat-template tokens, and how many were cut.

    That window is all the tokenize stage keeps and all the drafter ever sees the target
    continue, so pretraining spends its CPU budget there rather than on long tails.
    """
    texts = [tokenizer.apply_chat_template(row["messages"], tokenize=False) for row in rows]
    documents = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    cut = sum(max(0, len(d) - max_seq_len) for d in documents)
    return [d[:max_seq_len] for d in documents], cut


def pack(
    documents: list[list[int]], seq_len: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate documents and cut the stream into rows of ``seq_len``: no padding waste.

    Returns ``(input_ids, labels)``; labels equal the ids (the model shifts them) except on
    the padding that fills the last row, which is ``IGNORE``. The chat markup delimits
    documents, so rows may span several of them.
    """
    stream = torch.tensor([t for doc in documents for t in doc], dtype=torch.long)
    if stream.numel() == 0:
        raise ValueError("nothing to pack: the conversations encode to zero tokens")
    rows = math.ceil(stream.numel() / seq_len)
    input_ids = torch.full((rows * seq_len,), pad_id, dtype=torch.long)
    labels = torch.full((rows * seq_len,), IGNORE, dtype=torch.long)
    input_ids[: stream.numel()] = stream
    labels[: stream.numel()] = stream
    return input_ids.view(rows, seq_len), labels.view(rows, seq_len)


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to ``peak``, then cosine decay to a tenth of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def weighted_next_token_loss(
    logits: torch.Tensor, labels: torch.Tensor, end_id: int | None, end_weight: float
) -> torch.Tensor:
    """Next-token cross-entropy where labels equal to ``end_id`` weigh ``end_weight``.

    The weighted loss is minimised by ``p(end) ∝ end_weight · p_data(end)``: a weight ``w``
    adds ``log w`` to the log-odds of ending a turn. A tiny target that is far from the data
    (perplexity ~90) otherwise rarely ranks the end token first and loops until the cap.
    """
    logits, target = logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten()
    ce = F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="none")
    weight = (target != IGNORE).float()
    if end_id is not None and end_weight != 1.0:
        weight = weight * torch.where(target == end_id, end_weight, 1.0)
    return (ce * weight).sum() / weight.sum().clamp(min=1.0)


def pretrain(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    config: TargetConfig,
    end_id: int | None = None,
) -> dict:
    """Next-token pretraining over packed rows; rows are reshuffled every epoch (seeded).

    ``end_id`` (the end-of-turn token) weighs ``config.end_token_weight`` in the loss.
    """
    rows_per_batch = max(1, config.pretrain_batch_tokens // input_ids.shape[1])
    steps_per_epoch = math.ceil(input_ids.shape[0] / rows_per_batch)
    total = steps_per_epoch * config.pretrain_epochs
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.pretrain_lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(config.seed)
    model.train()
    losses: list[float] = []
    tokens = 0
    start = time.perf_counter()
    progress = progress_bar(total=total, desc="target pretrain", unit="step")
    for _ in range(config.pretrain_epochs):
        order = torch.randperm(input_ids.shape[0], generator=generator)
        for batch in order.split(rows_per_batch):
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(len(losses), total, config.pretrain_lr, max(1, total // 20))
            logits = model(input_ids=input_ids[batch]).logits
            loss = weighted_next_token_loss(logits, labels[batch], end_id, config.end_token_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            tokens += int((labels[batch] != IGNORE).sum())
            progress.update()
            progress.set_postfix(loss=f"{losses[-1]:.3f}")
    progress.close()
    model.eval()
    tail = losses[-max(1, steps_per_epoch // 4) :]
    return {
        "train_loss": sum(tail) / len(tail) if tail else None,
        "first_loss": losses[0] if losses else None,
        "steps": len(losses),
        "train_tokens": tokens,
        "train_seconds": time.perf_counter() - start,
    }


@torch.no_grad()
def heldout_loss(
    model: PreTrainedModel, input_ids: torch.Tensor, labels: torch.Tensor, rows_per_batch: int = 8
) -> tuple[float, int]:
    """Mean next-token cross-entropy over every labelled position, and how many there were."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for ids, lab in zip(input_ids.split(rows_per_batch), labels.split(rows_per_batch), strict=True):
        logits = model(input_ids=ids.to(device)).logits[:, :-1].float()
        target = lab[:, 1:].to(device)
        total += F.cross_entropy(
            logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum"
        ).item()
        count += int((target != IGNORE).sum())
    if count == 0:
        raise ValueError("held-out set has no labelled tokens")
    return total / count, count
