"""What a training run is made of, each part made by its own builder.

:class:`dflash.train.loop.Trainer` calls them in a fixed order (the drafter's initialisation
draws from the seeded RNG, so the order is part of the numerics), and each says what it reads:
the plan, the target as this rank holds it, the drafter, its feature source, the step, the
held-out batch, the run's directory, the loader and the resumable state.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflash.batching.io import read_plan_meta
from dflash.config.schema import Config
from dflash.data.store import TokenStore
from dflash.errors import ConfigError
from dflash.features.registry import build_features as build_source
from dflash.features.source import FeatureSource, Inputs, Kind
from dflash.features.target_forward import sliding_windows
from dflash.model.drafter_attention import flex_available
from dflash.model.load import load_target, target_device_dtype
from dflash.model.objective import Objective
from dflash.train.batches import PlannedSteps, StepBuilder, make_loader, micro_batch_options
from dflash.train.borrowed import load_borrowed
from dflash.train.checkpointing import best, checkpoint
from dflash.train.checkpointing.parts import ModelPart
from dflash.train.checkpointing.state import TrainState
from dflash.train.distributed import node_checks as nodes
from dflash.train.distributed.parallel import load_sharded_target, sharded, wrap_drafter
from dflash.train.distributed.process_group import Dist, from_rank_zero
from dflash.train.init_drafter import build_drafter
from dflash.train.observe.pilot import epoch_limits
from dflash.train.optim import Optimization
from dflash.train.plan_check import check_plan
from dflash.train.run_files import Declared, TrainFiles, weight_inputs
from dflash.train.simulated import SimulatedTau
from dflash.train.step import Step
from dflash.train.topology import Placement

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunPlan:
    """The epoch plans this run trains on, checked against the token store and the params."""

    store: TokenStore
    meta: dict
    """The plans' ``summary.json``."""
    epoch_steps: list[int]
    """Planned steps of each epoch the run trains."""
    run_steps: list[int]
    """Steps each epoch runs: all of them, or a pilot's first ``train.max_steps``."""
    tokens: int
    """Real tokens of those epochs' plans: what the projection of a whole run counts."""

    @property
    def total_steps(self) -> int:
        return sum(self.epoch_steps)

    @property
    def last_step(self) -> int:
        """The run's last global step: it is always validated (``train.eval_every``)."""
        return sum(self.run_steps)


def build_plan(config: Config, files: TrainFiles, ctx: Dist) -> RunPlan:
    store, meta, t = TokenStore(files.tokenized), read_plan_meta(files.plans), config.train
    check_plan(meta, store, config, ctx.world_size, files.plans)
    epochs = meta["epochs"][: t.epochs]
    steps = [e["n_steps"] for e in epochs]
    tokens = sum(e["real_tokens"] for e in epochs)
    return RunPlan(store, meta, steps, epoch_limits(steps, t.max_steps), tokens)


def build_target(kind: Kind, config: Config, files: TrainFiles, ctx: Dist) -> nn.Module:
    """The frozen target, whole on this rank's device or sharded over the ranks.

    Sharded, it is built on the meta device and each rank reads only its own shards, so
    neither a device nor a rank's host memory ever holds it whole. A rank whose features come
    from elsewhere holds only the parts the drafter borrows.
    """
    if not kind.whole_target:
        return load_borrowed(files.target, ctx.device, target_device_dtype()[1])
    if not sharded(ctx, config.train.parallelism):
        return load_target(files.target, device=ctx.device)
    return load_sharded_target(files.target, ctx)


def build_model(
    config: Config, files: TrainFiles, target: nn.Module, tokenizer, device: torch.device
) -> tuple[nn.Module, dict]:
    """The drafter on ``device`` (from scratch, or ``drafter.init_from``), and where each of its
    sizes came from."""
    drafter, sources = build_drafter(
        config.drafter, files.init, target, tokenizer, config.train.seed
    )
    drafter = drafter.to(device)
    drafter.recompute = config.train.recompute
    return drafter, sources


def build_features(
    config: Config,
    files: TrainFiles,
    placement: Placement,
    target: nn.Module,
    drafter: nn.Module,
    objective: Objective,
    autocast: contextlib.AbstractContextManager,
    tokenizer,
) -> FeatureSource:
    """The run's feature source (``train.topology``, ``train.features``): with the target's
    last hidden state after the drafter's layers where the objective distills."""
    layer_ids = drafter.config.target_layer_ids
    run = Inputs(
        config, files, placement, target, layer_ids, objective.distills, autocast, tokenizer
    )
    return build_source(run)


def build_step(
    config: Config,
    ctx: Dist,
    drafter: nn.Module,
    features: FeatureSource,
    objective: Objective,
    autocast: contextlib.AbstractContextManager,
    total_steps: int,
) -> Step:
    """The drafter wrapped for its parallelism, its optimizer and schedule over
    ``total_steps``, and what each step reads."""
    t = config.train
    model = wrap_drafter(drafter, ctx, t.parallelism)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optim = Optimization.build(drafter, t, total_steps, ctx.device.type == "cuda")
    return Step(
        ctx, model, params, features, objective, config.drafter.gamma, autocast, optim,
        t.clip_grad, t.max_nonfinite_steps,
    )  # fmt: skip


def build_simulated(
    config: Config,
    files: TrainFiles,
    features: FeatureSource,
    drafter: nn.Module,
    autocast: contextlib.AbstractContextManager,
) -> SimulatedTau | None:
    """The held-out batch simulated τ and validation measure the drafter on, as the feature
    source gives it; a run that validates needs one."""
    simulated = SimulatedTau.from_row(features.heldout(), drafter, autocast)
    every = config.train.eval_every
    if every and simulated is None:
        raise ConfigError(
            f"train.eval_every = {every} validates on held-out prompts, and "
            f"{files.heldout} has none: set train.eval_every = 0, or hold some out"
        )
    return simulated


def build_run_directory(
    config: Config, files: TrainFiles, declared: Declared, ctx: Dist
) -> tuple[str, Path]:
    """The run's fingerprint and checkpoint directory, agreed by every node and started on
    rank 0 (older runs beyond ``train.keep_runs`` removed)."""
    nodes.agree(ctx, files)
    fingerprint = from_rank_zero(
        ctx, lambda: checkpoint.run_fingerprint(files, weight_inputs(files, declared))
    )
    run_dir = checkpoint.run_directory(files.checkpoints, fingerprint)
    if ctx.is_main:
        keep = config.train.keep_runs
        checkpoint.start_run(files.checkpoints, fingerprint, declared.params, keep)
    nodes.check_shared(ctx, files.checkpoints)
    return fingerprint, run_dir


def build_loader(
    config: Config, store: TokenStore, ctx: Dist, target: nn.Module
) -> tuple[PlannedSteps, torch.utils.data.DataLoader]:
    """One loader for the whole run: its workers serve every epoch's plan in turn."""
    options = micro_batch_options(config, sliding_windows(target), flex_available(ctx.device))
    planned, t = PlannedSteps(), config.train
    cuda = ctx.device.type == "cuda"
    builder = StepBuilder(store, **options)
    loader = make_loader(builder, t.num_workers, t.prefetch, cuda, sampler=planned)
    return planned, loader


def build_state(
    ctx: Dist, drafter: nn.Module, optim: Optimization, fingerprint: str, run_dir: Path
) -> tuple[TrainState, dict]:
    """The run's state and the checkpointed parts, resumed from the run's last checkpoint
    when there is one; a fresh run forgets the best weights an earlier one kept."""
    state = TrainState()
    parts = {"train_state": state, "drafter": ModelPart(drafter), **optim.parts(drafter)}
    resumed = checkpoint.resume(ctx, parts, fingerprint, run_dir) is not None
    if resumed and ctx.is_main:
        s = state
        logger.info(
            f"resumed at epoch {s.epoch} step {s.step_in_epoch} (global step {s.global_step})"
        )
    if not resumed and ctx.is_main:
        best.clear(run_dir)
    return state, parts
