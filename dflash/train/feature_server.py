"""A decoupled target rank: the frozen target, serving features to the drafter ranks.

It reads the same plan as the drafter ranks, builds the micro-batches the layout assigns to it
(:func:`dflash.train.topology.schedule`) and sends each one's features to its drafter rank,
keeping at most ``train.feature_prefetch`` sends per drafter rank unfinished. The time spent
blocked on those sends is the target's idle time. Target ranks that shard the target run one
forward per round in lockstep, a padding forward where the round has no micro-batch for them.
It holds no trainable state: a resumed run tells it where the drafter ranks start.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.batching.io import epoch_path, read_plan_meta, read_rank_plan
from dflash.config.schema import Config
from dflash.data.store import TokenStore
from dflash.data.tokenizer import load_tokenizer
from dflash.model.distill import objective_of
from dflash.model.features import sliding_windows, target_features
from dflash.model.load import load_target
from dflash.train import simulated
from dflash.train.batches import build_micro_batch
from dflash.train.distributed.parallel import load_sharded_target
from dflash.train.distributed.process_group import Dist
from dflash.train.distributed.ranks import RankLayout
from dflash.train.init_drafter import tapped_layers
from dflash.train.observe.pilot import epoch_limits
from dflash.train.run_files import TrainFiles
from dflash.train.step import micro_batch_features
from dflash.train.topology import fractions, schedule, start_point, wait

ROW = ("input_ids", "document_ids", "position_ids", "loss_mask")
"""The integer tensors of the simulated-τ row, sent in this order before its features."""


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """The training step's autocast: bf16 on CUDA, none on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class BoundedSender:
    """Sends features, at most ``limit`` unfinished per drafter rank; times the blocking."""

    def __init__(self, layout: RankLayout, limit: int) -> None:
        self.layout, self.limit = layout, limit
        self.pending = {d: deque() for d in range(layout.drafter_ranks)}
        self.idle_s = 0.0

    def send(self, features: torch.Tensor, drafter: int, index: int) -> None:
        if len(self.pending[drafter]) >= self.limit:
            self._finish_oldest(drafter)
        self.pending[drafter].append((index, features, dist.isend(features, dst=drafter)))

    def _finish_oldest(self, drafter: int) -> None:
        index, _, work = self.pending[drafter].popleft()
        began = time.perf_counter()
        wait(work, self.layout, drafter, f"to take micro-batch {index}")
        self.idle_s += time.perf_counter() - began

    def drain(self) -> None:
        for drafter, queue in self.pending.items():
            while queue:
                self._finish_oldest(drafter)


def send_row(row: dict[str, torch.Tensor] | None, layout: RankLayout, device) -> None:
    """The simulated-τ row to every drafter rank: its length (0: none), then its tensors."""
    length = 0 if row is None else row["input_ids"].shape[1]
    for drafter in range(layout.drafter_ranks):
        header = torch.tensor([length], dtype=torch.int64, device=device)
        tensors = [header] + ([] if row is None else [row[k] for k in ROW] + [row["features"]])
        works = [dist.isend(t.contiguous(), dst=drafter) for t in tensors]
        for work in works:
            wait(work, layout, drafter, "to take the simulated-τ row")


def receive_row(layout: RankLayout, width: int, dtype: torch.dtype, device) -> dict | None:
    """The row :func:`send_row` sends, on a drafter rank."""
    source = layout.drafter_ranks
    header = torch.zeros(1, dtype=torch.int64, device=device)
    wait(dist.irecv(header, src=source), layout, source, "to send the simulated-τ row")
    length = int(header[0])
    if length == 0:
        return None
    row = {k: torch.empty((1, length), dtype=torch.int64, device=device) for k in ROW}
    row["features"] = torch.empty((1, length, width), dtype=dtype, device=device)
    works = [dist.irecv(row[k], src=source) for k in (*ROW, "features")]
    for work in works:
        wait(work, layout, source, "to send the simulated-τ row")
    return row


def serve(config: Config, files: TrainFiles, ctx: Dist, layout: RankLayout) -> None:
    """Run a target rank from the drafter ranks' start point to the end of the last epoch.

    ``ctx`` is the target ranks' group when they shard the target (:func:`dflash.train.
    topology.place`); every target rank then runs the same forwards, the simulated-τ
    capture's included, so that their all-gathers pair up.
    """
    target = served_target(files.target, ctx, layout)
    d, t = config.drafter, config.train
    layer_ids = tapped_layers(d, files.init, target.config.num_hidden_layers)
    dtype, autocast = target.get_input_embeddings().weight.dtype, autocast_for(ctx.device)
    distills = objective_of(config).distills
    if ctx.rank == layout.drafter_ranks or layout.sharded_target:
        tokenizer = load_tokenizer(files.tokenizer)
        options = dict(config.data.chat_template_kwargs)
        row = simulated.capture(
            files.heldout, target, tokenizer, layer_ids, config.data.max_seq_len, autocast, options
        )
        if ctx.rank == layout.drafter_ranks:
            send_row(row, layout, ctx.device)
    first_epoch, first_step = start_point(ctx, 0, 0)
    began = time.perf_counter()
    store, sender = TokenStore(files.tokenized), BoundedSender(layout, t.feature_prefetch)
    windows = sliding_windows(target)
    planned = [e["n_steps"] for e in read_plan_meta(files.plans)["epochs"]][: t.epochs]
    limits = epoch_limits(planned, t.max_steps)  # a pilot's drafter ranks stop there too
    for epoch in range(first_epoch, t.epochs):
        path = epoch_path(files.plans, epoch)
        rank_steps = [read_rank_plan(path, r)[: limits[epoch]] for r in range(layout.drafter_ranks)]
        first = first_step if epoch == first_epoch else 0
        for work in schedule(layout, ctx.rank, rank_steps, first):
            if work is None:
                with torch.inference_mode(), autocast:
                    padding_forward(target, layer_ids, ctx.device)
                continue
            drafter, index, rows = work
            mb = build_micro_batch(
                store, rows, block_size=d.block_size, anchors_per_sequence=d.anchors_per_sequence,
                gamma=d.gamma, seed=t.seed, epoch=epoch, windows=windows,
                position_weight=config.objective.position_weight,
            ).to(ctx.device)  # fmt: skip
            with torch.inference_mode(), autocast:
                features = micro_batch_features(target, layer_ids, mb, distills)
            sender.send(features.to(dtype).contiguous(), drafter, index)
    sender.drain()
    busy = time.perf_counter() - began - sender.idle_s
    fractions(ctx, sender.idle_s, busy, "target")


def served_target(path: Path, ctx: Dist, layout: RankLayout) -> torch.nn.Module:
    """The target whole on this rank's device, or this rank's FSDP shards of it."""
    if layout.sharded_target:
        return load_sharded_target(path, ctx)
    return load_target(path, device=ctx.device)


def padding_forward(target: torch.nn.Module, layer_ids: list[int], device: torch.device) -> None:
    """A one-token forward whose features are dropped: the round's forward of a sharded
    target rank that has no micro-batch in it, so the target ranks' all-gathers pair up."""
    one = torch.zeros((1, 1), dtype=torch.int64, device=device)
    target_features(target, one, one, one, layer_ids)
