"""The training loop: each rank runs exactly the micro-batches its epoch plans assign to it.

Per step, :func:`dflash.train.step.forward_backward` accumulates the gradients of the rank's
``grad_accum`` micro-batches; the loop clips them, takes one optimizer step (skipped, and
counted, when the loss or the gradients are not finite), and keeps the run's state, logs and
checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from typing import Any

import torch

from dflash.batching.errors import InvalidPlanError
from dflash.batching.io import epoch_path, read_plan_meta, read_rank_plan
from dflash.config.schema import Config
from dflash.data.store import TokenStore
from dflash.data.tokenizer import load_tokenizer
from dflash.errors import ConfigError, RunStopped
from dflash.fileio import remove_files
from dflash.metrics.headline import write_metrics
from dflash.metrics.schema import TrainDetails, TrainHeadline
from dflash.model.distill import objective_of
from dflash.model.drafter_attention import flex_available
from dflash.model.export import export_run
from dflash.model.features import sliding_windows
from dflash.model.load import load_target, target_device_dtype
from dflash.pipeline.fingerprint import path_digest
from dflash.progress import progress_bar
from dflash.train import topology
from dflash.train.batches import MicroBatch, PlannedSteps, StepBuilder, make_loader
from dflash.train.borrowed import load_borrowed
from dflash.train.checkpointing import best, checkpoint
from dflash.train.checkpointing.parts import ModelPart, full_model_state
from dflash.train.checkpointing.state import TrainState
from dflash.train.distributed import node_checks as nodes
from dflash.train.distributed.parallel import (
    borrowed_unsharded,
    clip_grad_norm,
    load_sharded_target,
    sharded,
    wrap_drafter,
)
from dflash.train.distributed.process_group import (
    Dist,
    all_reduce_sum,
    barrier,
    from_rank_zero,
    init_distributed,
    shutdown,
)
from dflash.train.engine import by_document, document_features
from dflash.train.feature_server import receive_row, serve
from dflash.train.init_drafter import build_drafter
from dflash.train.observe.clock import StepClock
from dflash.train.observe.composition import class_name, length_classes
from dflash.train.observe.monitor import Monitor
from dflash.train.observe.pilot import epoch_limits
from dflash.train.observe.summary import run_summary
from dflash.train.observe.window import Window, mean_sample_length
from dflash.train.optim import Optimization
from dflash.train.plan_check import check_epoch_file, check_plan
from dflash.train.run_files import Declared, TrainFiles, weight_inputs
from dflash.train.simulated import SimulatedTau
from dflash.train.step import forward_backward
from dflash.train.topology import Placement, feature_source

logger = logging.getLogger(__name__)


class TrainingError(RunStopped):
    """The run cannot go on (too many non-finite losses, a stale plan, ...)."""


def train(config: Config, files: TrainFiles, declared: Declared) -> None:
    world = init_distributed()
    try:
        placement = topology.place(config.train, world)
        with topology.naming_role(placement.layout, world.rank):
            if placement.serves_target:
                serve(config, files, placement.ctx, placement.layout)
            else:
                Trainer(config, files, declared, placement.ctx, placement).fit()
    finally:
        checkpoint.release_runs()
        shutdown(world)


class Trainer:
    def __init__(
        self,
        config: Config,
        files: TrainFiles,
        declared: Declared,
        ctx: Dist,
        placement: Placement | None = None,
    ) -> None:
        self.config = config
        self.files = files
        self.declared = declared
        self.ctx = ctx
        self.placement = placement or Placement(ctx, None)
        torch.manual_seed(config.train.seed)
        self.store = TokenStore(files.tokenized)
        self.plan_meta = read_plan_meta(files.plans)
        check_plan(self.plan_meta, self.store, config, ctx.world_size, files.plans)
        self.epoch_steps = [e["n_steps"] for e in self.plan_meta["epochs"]][: config.train.epochs]
        self.total_steps = sum(self.epoch_steps)
        self.run_steps = epoch_limits(self.epoch_steps, config.train.max_steps)
        """Steps each epoch runs: all of them, or a pilot's first ``train.max_steps``."""
        self.last_step = sum(self.run_steps)
        """The run's last global step: it is always validated (``train.eval_every``)."""
        epochs = self.plan_meta["epochs"][: config.train.epochs]
        self.plan_tokens = sum(e["real_tokens"] for e in epochs)
        self.length_classes = length_classes(files.buckets)
        self.timed: list[tuple[float, int]] = []
        """``(seconds, real tokens)`` of this process's steps past warm-up: the projection."""

        self.target = self._load_target()
        tokenizer = load_tokenizer(files.tokenizer)
        drafter, self.drafter_sources = build_drafter(
            config.drafter, files.init, self.target, tokenizer, config.train.seed
        )
        self.drafter = drafter.to(ctx.device)
        self.drafter.recompute = config.train.recompute
        self.layer_ids = self.drafter.config.target_layer_ids
        t = config.train
        self.objective = objective_of(config)
        self.features = (
            document_features(config, files, ctx, self.target, self.layer_ids)
            if by_document(t)
            else feature_source(
                self.placement, self.target, self.layer_ids, t.feature_prefetch,
                last=self.objective.distills,
            )
        )  # fmt: skip
        self.model = wrap_drafter(self.drafter, ctx, t.parallelism)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        fused = ctx.device.type == "cuda"
        self.optim = Optimization.build(self.drafter, t, self.total_steps, fused)
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if ctx.device.type == "cuda"
            else contextlib.nullcontext()
        )
        self.simulated = self._simulated(tokenizer)
        if t.eval_every and self.simulated is None:
            raise ConfigError(
                f"train.eval_every = {t.eval_every} validates on held-out prompts, and "
                f"{files.heldout} has none: set train.eval_every = 0, or hold some out"
            )
        nodes.agree(ctx, files)
        self.fingerprint = from_rank_zero(
            ctx, lambda: checkpoint.run_fingerprint(files, weight_inputs(files, declared))
        )
        self.run_dir = checkpoint.run_directory(files.checkpoints, self.fingerprint)
        if ctx.is_main:
            checkpoint.start_run(files.checkpoints, self.fingerprint, declared.params, t.keep_runs)
        nodes.check_shared(ctx, files.checkpoints)
        self.planned, self.loader = self._make_loader()
        self.clock = StepClock(ctx.device)
        self.state = TrainState()
        self.parts = {
            "train_state": self.state,
            "drafter": ModelPart(self.drafter),
            **self.optim.parts(self.drafter),
        }
        resumed = checkpoint.resume(ctx, self.parts, self.fingerprint, self.run_dir) is not None
        if resumed and ctx.is_main:
            s = self.state
            logger.info(
                f"resumed at epoch {s.epoch} step {s.step_in_epoch} (global step {s.global_step})"
            )
        if not resumed and ctx.is_main:
            best.clear(self.run_dir)

    def _load_target(self):
        """The frozen target, whole on this rank's device or sharded over the ranks.

        Sharded, it is built on the meta device and each rank reads only its own shards, so
        neither a device nor a rank's host memory ever holds it whole. A decoupled drafter rank
        holds only the parts the drafter borrows.
        """
        if self.placement.layout is not None or by_document(self.config.train):
            return load_borrowed(self.files.target, self.ctx.device, target_device_dtype()[1])
        if not sharded(self.ctx, self.config.train.parallelism):
            return load_target(self.files.target, device=self.ctx.device)
        return load_sharded_target(self.files.target, self.ctx)

    def _simulated(self, tokenizer) -> SimulatedTau | None:
        """The held-out batch for τ; a decoupled drafter rank gets its target part sent, a
        files run reads what the capture stage wrote."""
        layout, c = self.placement.layout, self.config
        if c.train.features == "files":
            from dflash.train.capture import heldout_row

            row = heldout_row(self.files.features, self.ctx.device)
            return SimulatedTau.from_row(row, self.drafter, self.autocast)
        if by_document(c.train):
            return None  # engines: no target here to write the batch's answers
        if layout is not None:
            width = len(self.layer_ids) * self.target.config.hidden_size  # features only
            row = receive_row(layout, width, self.features.dtype, self.ctx.device)
            return SimulatedTau.from_row(row, self.drafter, self.autocast)
        options = dict(c.data.chat_template_kwargs)
        return SimulatedTau.build(
            self.files.heldout,
            self.target,
            tokenizer,
            self.drafter,
            c.data.max_seq_len,
            self.autocast,
            options,
        )

    # ----------------------------------------------------------------- the loop
    def fit(self) -> None:
        """Train; ``metrics/train.json``, written last, records the drafter it finished.

        It is removed first, so after an interrupted run its absence says that
        ``models/drafter`` (if any) is older than the last run (:mod:`dflash.pipeline.freshness`),
        and a kill never leaves the previous run's metrics beside a new drafter.
        """
        t = self.config.train
        if self.ctx.is_main:
            remove_files(self.files.metrics, self.files.details)
        s = self.state
        f = self.files
        monitor = (
            Monitor(self.config, f.log, f.live, self.declared.params, s.rows, s.history)
            if self.ctx.is_main
            else None
        )
        self.features.start(s.epoch, s.step_in_epoch)
        while s.epoch < t.epochs:
            if s.step_in_epoch < self.run_steps[s.epoch]:
                self._run_epoch(s.epoch, monitor)
            s.epoch += 1
            s.step_in_epoch = 0
        balance = self.features.finish()
        forwards = torch.tensor([balance.pop("target_forwards")], dtype=torch.float64)
        balance["target_forwards"] = int(all_reduce_sum(self.ctx, forwards)[0])
        self._save()
        summary = run_summary(
            s, tau_seconds=self.simulated.seconds if self.simulated else None,
            plan_tokens=self.plan_tokens, timed=self.timed, planned_steps=self.total_steps,
            epochs=t.epochs, world_size=self.ctx.world_size,
            drafter_sources=self.drafter_sources,
        ) | balance  # fmt: skip
        if t.keep_best and s.best_step >= 0:
            weights = best.load(self.run_dir, s.best_step) if self.ctx.is_main else {}
            summary |= {
                "best_step": s.best_step,
                "best_val_simulated_tau": s.best_val_simulated_tau,
            }
            if self.ctx.is_main:
                logger.info(
                    f"exporting the drafter of step {s.best_step}, the best validation "
                    f"(val_simulated_tau {s.best_val_simulated_tau:.4f})"
                )
        else:
            weights = full_model_state(self.drafter)
        if self.ctx.is_main:
            summary |= monitor.stability()
            export_run(
                self.drafter, self.config, f.drafter, f.target, self.declared.params,
                self.target.config, summary, weights,
            )  # fmt: skip
            summary["drafter_sha256"] = path_digest(f.drafter)
            details = TrainDetails.model_validate(summary)
            write_metrics(f.metrics, f.details, details, TrainHeadline)
            monitor.finish(summary, f.steps)
            logger.info(f"done: {json.dumps(summary)}")
        barrier(self.ctx)

    def _run_epoch(self, epoch: int, monitor: Monitor | None) -> None:
        c = self.config
        steps = self._epoch_steps(epoch)[: self.run_steps[epoch]]
        self.features.epoch(steps, self.state.step_in_epoch)
        self.planned.set_epoch(epoch, steps, self.state.step_in_epoch)
        bar = progress_bar(
            total=self.run_steps[epoch],
            initial=self.state.step_in_epoch,
            desc=f"epoch {epoch + 1}/{c.train.epochs}",
            unit="step",
            disable=not self.ctx.is_main,
            dynamic_ncols=True,
        )
        window = Window()
        iterator = iter(self.loader)
        for _ in range(len(self.planned)):
            t0 = time.perf_counter()
            began = self.clock.start()
            micro_batches = next(iterator)
            wait = time.perf_counter() - t0
            result = self._step(micro_batches)
            seconds, timed = self.clock.stop(began)
            self._record(epoch, result, seconds, wait, timed)
            length_class = class_name(self.length_classes, mean_sample_length(result))
            window.add(result, seconds, wait, length_class)
            if monitor is not None:
                monitor.step(result, self.state.global_step, mean_sample_length(result))
            bar.update(1)
            bar.set_postfix(loss=f"{result['loss']:.3f}", lr=f"{result['lr']:.2e}")
            step = self.state.global_step
            epoch_end = self.state.step_in_epoch == self.run_steps[epoch]
            row = {}
            if c.train.eval_every and (step % c.train.eval_every == 0 or step == self.last_step):
                row = {"step": step, "epoch": epoch} | self._validate(step)  # every rank
            if step % c.logging.every == 0 or epoch_end:
                tau = self._simulated_tau(row.get("val_simulated_tau"))  # every rank: FSDP-safe
                row = window.row(step, epoch) | tau | row
                window = Window()
            if row and monitor is not None:
                monitor.log(row)
            if step % c.train.checkpoint_every == 0:
                self._save()
        bar.close()

    def _simulated_tau(self, validated: float | None = None) -> dict[str, float]:
        """τ of the current drafter on the fixed held-out batch (none without held-out data);
        ``validated``, this step's validation τ, is the same figure, so it is not measured again."""
        if self.simulated is None:
            return {}
        if validated is not None:
            return {"simulated_tau": validated}
        with borrowed_unsharded(self.drafter):  # the target's embedding and head, gathered
            return {"simulated_tau": self.simulated.measure(self.drafter)}

    def _validate(self, step: int) -> dict[str, float]:
        """The ``val_*`` figures of the current drafter on the held-out batch; with
        ``train.keep_best``, its whole weights kept when its τ beats every earlier one."""
        with borrowed_unsharded(self.drafter):
            figures = self.simulated.validate(
                self.drafter, self.objective, self.config.drafter.gamma
            )
        if self.config.train.keep_best:
            self._keep_if_best(step, figures["val_simulated_tau"])
        return figures

    def _keep_if_best(self, step: int, measured: float) -> None:
        """Keep the drafter's whole weights when its τ beats every earlier validation's (a
        tie keeps the earlier step); rank 0's τ decides for all, so the ranks agree."""
        s = self.state
        tau = from_rank_zero(self.ctx, lambda: measured)
        if tau > s.best_val_simulated_tau:
            weights = full_model_state(self.drafter)  # a collective: every rank
            if self.ctx.is_main:
                best.keep(self.run_dir, step, weights)
            s.best_step, s.best_val_simulated_tau = step, tau

    def _save(self) -> None:
        keep, step = self.config.train.keep_checkpoints, self.state.global_step
        checkpoint.save_checkpoint(
            self.run_dir, step, self.parts, self.fingerprint, keep, self.ctx.group
        )
        if self.config.train.keep_best and self.ctx.is_main:
            best.prune(self.run_dir, self.state.best_step)  # the checkpoint records it now

    def _epoch_steps(self, epoch: int) -> list:
        """This rank's steps of the epoch's plan, checked against the plan's summary."""
        path = epoch_path(self.files.plans, epoch)
        check_epoch_file(path, self.plan_meta, epoch)
        steps = read_rank_plan(path, self.ctx.rank)
        if len(steps) != self.epoch_steps[epoch]:
            raise InvalidPlanError(
                f"{path}: rank {self.ctx.rank} has {len(steps)} steps, summary.json says "
                f"{self.epoch_steps[epoch]}; rerun `dflash plan`"
            )
        return steps

    def _make_loader(self) -> tuple[PlannedSteps, torch.utils.data.DataLoader]:
        """One loader for the whole run: its workers serve every epoch's plan in turn."""
        c = self.config
        builder = StepBuilder(
            self.store,
            block_size=c.drafter.block_size,
            anchors_per_sequence=c.drafter.anchors_per_sequence,
            gamma=c.drafter.gamma,
            seed=c.train.seed,
            flex=flex_available(self.ctx.device),
            windows=sliding_windows(self.target),
            position_weight=c.objective.position_weight,
        )
        planned = PlannedSteps()
        cuda = self.ctx.device.type == "cuda"
        return planned, make_loader(
            builder, c.train.num_workers, c.train.prefetch, cuda, sampler=planned
        )

    def _record(
        self, epoch: int, result: dict[str, Any], seconds: float, wait: float, timed: bool
    ) -> None:
        """Count a finished step into the run's state (checkpointed, so resumes continue it)."""
        s = self.state
        s.step_in_epoch += 1
        s.global_step += 1
        s.elapsed_s += seconds
        s.data_wait_s += wait
        s.real_tokens += result["real_tokens"]
        s.padded_tokens += result["padded_tokens"]
        if timed:
            self.timed.append((seconds, result["real_tokens"]))
            s.timed_s += seconds
            s.timed_real_tokens += result["real_tokens"]
            s.timed_padded_tokens += result["padded_tokens"]
        if result["finite"]:
            s.epoch_loss.append((epoch, result["loss"], result["weight"]))

    def _step(self, micro_batches: list[MicroBatch]) -> dict[str, Any]:
        """Gradients of the step's micro-batches, then one update unless the loss is not finite."""
        c = self.config
        totals = forward_backward(
            self.ctx,
            self.target,
            self.model,
            self.layer_ids,
            micro_batches,
            c.drafter.gamma,
            self.autocast,
            self.features,
            self.objective,
        )
        grad_norm = clip_grad_norm(self.params, c.train.clip_grad)
        lr = self.optim.lr
        finite = math.isfinite(totals.loss) and math.isfinite(grad_norm) and totals.weight > 0
        if finite:
            self.optim.step()
            self.state.nonfinite_in_a_row = 0
        else:
            self._skip_step()
        self.optim.zero_grad()
        self.optim.schedule_step()
        return {**totals._asdict(), "finite": finite, "grad_norm": grad_norm, "lr": lr}

    def _skip_step(self) -> None:
        s = self.state
        s.skipped_steps += 1
        s.nonfinite_in_a_row += 1
        limit = self.config.train.max_nonfinite_steps
        if s.nonfinite_in_a_row >= limit:
            raise TrainingError(
                f"{s.nonfinite_in_a_row} non-finite losses in a row (limit "
                f"train.max_nonfinite_steps = {limit}) at global step "
                f"{s.global_step}: lower train.lr or check the data"
            )
