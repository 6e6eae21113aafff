"""The training loop: each rank runs exactly the micro-batches its epoch plans assign to it.

A run is built part by part (:mod:`dflash.train.build`); each step is
:func:`dflash.train.step.train_step`, and the loop keeps the run's state, logs and
checkpoints around it. Where the target features come from is the feature source's business
(:mod:`dflash.features.source`): the loop only starts it, hands it each epoch and ends it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from dflash.batching.errors import InvalidPlanError
from dflash.batching.io import epoch_path, read_rank_plan
from dflash.config.schema import Config
from dflash.data.tokenizer import load_tokenizer
from dflash.features.registry import kind_of
from dflash.fileio import remove_files
from dflash.metrics.headline import write_metrics
from dflash.metrics.schema import TrainDetails, TrainHeadline
from dflash.model.drafter import drafter_autocast
from dflash.model.export import export_run
from dflash.model.objective import objective_of
from dflash.pipeline.fingerprint import path_digest
from dflash.progress import progress_bar
from dflash.train import build
from dflash.train.checkpointing import best, checkpoint
from dflash.train.checkpointing.parts import full_model_state
from dflash.train.distributed.parallel import borrowed_unsharded
from dflash.train.distributed.process_group import (
    Dist,
    all_reduce_sum,
    barrier,
    from_rank_zero,
    init_distributed,
    shutdown,
)
from dflash.train.observe.clock import StepClock
from dflash.train.observe.composition import class_name, length_classes
from dflash.train.observe.monitor import Monitor
from dflash.train.observe.summary import run_summary
from dflash.train.observe.window import Window, mean_sample_length
from dflash.train.plan_check import check_epoch_file
from dflash.train.run_files import Declared, TrainFiles
from dflash.train.simulated import ROW_FIGURES
from dflash.train.step import train_step
from dflash.train.topology import Placement, naming_role

logger = logging.getLogger(__name__)


def train(config: Config, files: TrainFiles, declared: Declared) -> None:
    world = init_distributed()
    try:
        placement = kind_of(config.train).place(config.train, world)
        with naming_role(placement.layout, world.rank):
            if placement.serve is not None:
                placement.serve(config, files)
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
        self.config, self.files, self.declared, self.ctx = config, files, declared, ctx
        self.placement = placement or Placement(ctx)
        torch.manual_seed(config.train.seed)
        self.plan = build.build_plan(config, files, ctx)
        self.total_steps, self.plan_tokens = self.plan.total_steps, self.plan.tokens
        self.length_classes = length_classes(files.buckets)
        self.timed: list[tuple[float, int]] = []
        """``(seconds, real tokens)`` of this process's steps past warm-up: the projection."""
        self.target = build.build_target(kind_of(config.train), config, files, ctx)
        tokenizer = load_tokenizer(files.tokenizer)
        self.drafter, self.drafter_sources = build.build_model(
            config, files, self.target, tokenizer, ctx.device
        )
        self.objective = objective = objective_of(config)
        autocast = drafter_autocast(ctx.device)
        self.features = build.build_features(
            config, files, self.placement, self.target, self.drafter, objective, autocast,
            tokenizer,
        )  # fmt: skip
        self.step = build.build_step(
            config, ctx, self.drafter, self.features, objective, autocast, self.total_steps
        )
        self.simulated = build.build_simulated(config, files, self.features, self.drafter, autocast)
        self.fingerprint, self.run_dir = build.build_run_directory(config, files, declared, ctx)
        self.planned, self.loader = build.build_loader(config, self.plan.store, ctx, self.target)
        self.clock = StepClock(ctx.device)
        self.state, self.parts = build.build_state(
            ctx, self.drafter, self.step.optim, self.fingerprint, self.run_dir
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
            if s.step_in_epoch < self.plan.run_steps[s.epoch]:
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
        steps = self._epoch_steps(epoch)[: self.plan.run_steps[epoch]]
        self.features.epoch(steps, self.state.step_in_epoch)
        self.planned.set_epoch(epoch, steps, self.state.step_in_epoch)
        bar = progress_bar(
            total=self.plan.run_steps[epoch],
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
            result = train_step(self.step, micro_batches, self.state)
            seconds, timed = self.clock.stop(began)
            self._record(epoch, result, seconds, wait, timed)
            length_class = class_name(self.length_classes, mean_sample_length(result))
            window.add(result, seconds, wait, length_class)
            if monitor is not None:
                monitor.step(result, self.state.global_step, mean_sample_length(result))
            bar.update(1)
            bar.set_postfix(loss=f"{result['loss']:.3f}", lr=f"{result['lr']:.2e}")
            step = self.state.global_step
            epoch_end = self.state.step_in_epoch == self.plan.run_steps[epoch]
            row = {}
            last = step == self.plan.last_step
            if c.train.eval_every and (step % c.train.eval_every == 0 or last):
                row = {"step": step, "epoch": epoch} | self._validate(step)  # every rank
            if step % c.logging.every == 0 or epoch_end:
                tau = self._simulated_tau(row)  # every rank: FSDP-safe
                row = window.row(step, epoch) | tau | row
                window = Window()
            if row and monitor is not None:
                monitor.log(row)
            if step % c.train.checkpoint_every == 0:
                self._save()
        bar.close()

    def _simulated_tau(self, validated: dict[str, float]) -> dict[str, float]:
        """τ of the current drafter on the fixed held-out batch, and a selector's figures (none
        without held-out data); a validation this step, ``validated``, measured the same figures,
        so they are not measured again."""
        if self.simulated is None:
            return {}
        if "val_simulated_tau" in validated:
            return {k: validated[f"val_{k}"] for k in ROW_FIGURES if f"val_{k}" in validated}
        with borrowed_unsharded(self.drafter):  # the target's embedding and head, gathered
            return self.simulated.row_figures(self.drafter)

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
        check_epoch_file(path, self.plan.meta, epoch)
        steps = read_rank_plan(path, self.ctx.rank)
        if len(steps) != self.plan.epoch_steps[epoch]:
            raise InvalidPlanError(
                f"{path}: rank {self.ctx.rank} has {len(steps)} steps, summary.json says "
                f"{self.plan.epoch_steps[epoch]}; rerun `dflash plan`"
            )
        return steps

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
