"""The training loop: each rank runs exactly the micro-batches its epoch plans assign to it.

Per step: the ``grad_accum`` micro-batches of this rank, target features without gradients,
the DFlash objective, backward under DDP (gradients synchronised on the last micro-batch
only), one optimizer step. The loss is normalised by the loss-weight sum of the whole step
over all ranks, computed before the forward from the anchors, so every token weighs the same
whatever the batching strategy or the way samples fall onto ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm
from transformers import get_cosine_schedule_with_warmup

import dflash.model
from dflash import paths
from dflash.batching.io import epoch_path, read_plan_meta, read_rank_plan
from dflash.config import Config
from dflash.data.store import TokenStore
from dflash.data.tokenizer import MASK_TOKEN, load_tokenizer
from dflash.fileio import sha256_file, write_json_atomic
from dflash.model.drafter import DFlashDrafter
from dflash.model.features import target_features
from dflash.model.objective import dflash_objective
from dflash.model.target import load_target
from dflash.train import checkpoint
from dflash.train.batches import MicroBatch, StepDataset, make_loader
from dflash.train.distributed import Dist, all_reduce_sum, barrier, init_distributed, shutdown
from dflash.train.monitor import Monitor
from dflash.train.plan_check import StalePlanError, check_epoch_file, check_plan

MODEL_CODE = Path(dflash.model.__file__).parent


class DrafterDDP(DistributedDataParallel):
    """DDP that also exposes what the objective reads from the drafter besides its forward.

    ``head`` is the frozen, borrowed LM head, so using it outside DDP's forward leaves
    gradient synchronisation untouched.
    """

    @property
    def config(self):
        return self.module.config

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.module.head()


class TrainingError(RuntimeError):
    """The run cannot go on (too many non-finite losses, a stale plan, ...)."""


def train(config: Config) -> None:
    ctx = init_distributed()
    try:
        Trainer(config, ctx).fit()
    finally:
        shutdown(ctx)


class Trainer:
    def __init__(self, config: Config, ctx: Dist) -> None:
        self.config = config
        self.ctx = ctx
        torch.manual_seed(config.train.seed)
        self.store = TokenStore(paths.TOKENIZED)
        self.plan_meta = read_plan_meta(paths.PLANS)
        check_plan(self.plan_meta, self.store, config, ctx.world_size)
        self.epoch_steps = [e["n_steps"] for e in self.plan_meta["epochs"]][: config.train.epochs]
        self.total_steps = sum(self.epoch_steps)

        self.target = load_target(paths.TARGET, device=ctx.device)
        tokenizer = load_tokenizer(paths.TOKENIZER)
        mask_token_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        d = config.drafter
        self.drafter = DFlashDrafter.from_target(
            self.target,
            block_size=d.block_size,
            num_hidden_layers=d.num_hidden_layers,
            num_target_features=d.num_target_features,
            mask_token_id=mask_token_id,
            seed=config.train.seed,
        ).to(ctx.device)
        self.layer_ids = self.drafter.config.target_layer_ids
        self.model = DrafterDDP(self.drafter) if ctx.enabled else self.drafter
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        t = config.train
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=t.lr,
            betas=t.betas,
            weight_decay=t.weight_decay,
            fused=ctx.device.type == "cuda",
        )
        self.scheduler = get_cosine_schedule_with_warmup(
            self.optimizer,
            num_warmup_steps=math.ceil(t.warmup_ratio * self.total_steps),
            num_training_steps=self.total_steps,
        )
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if ctx.device.type == "cuda"
            else contextlib.nullcontext()
        )
        self.fingerprint = run_fingerprint(config, self.plan_meta, self.store.manifest)
        self.state: dict[str, Any] = {
            "epoch": 0,
            "step_in_epoch": 0,
            "global_step": 0,
            "nonfinite_in_a_row": 0,
            "skipped_steps": 0,
            "elapsed_s": 0.0,
            "data_wait_s": 0.0,
            "real_tokens": 0,
            "padded_tokens": 0,
            "epoch_loss": [],
            "rows": [],
        }
        self._resume()

    # ----------------------------------------------------------------- resume / save
    def _resume(self) -> None:
        saved, skipped = checkpoint.load_latest(paths.CHECKPOINTS, self.fingerprint)
        if self.ctx.is_main:
            for reason in skipped:
                print(f"[train] skipping checkpoint {reason}")
        barrier(self.ctx)
        if saved is None:
            if self.ctx.is_main and checkpoint.list_checkpoints(paths.CHECKPOINTS):
                print("[train] no checkpoint of this run: starting fresh, old ones removed")
                checkpoint.remove_checkpoints(paths.CHECKPOINTS)
            barrier(self.ctx)
            return
        if self.ctx.is_main:
            # Newer files passed over (unfinished, corrupt, another run's) would otherwise be
            # counted as "newest" when pruning and crowd out the checkpoints this run writes.
            for path in checkpoint.list_checkpoints(paths.CHECKPOINTS):
                if checkpoint.step_of(path) > saved["state"]["global_step"]:
                    checkpoint.remove_checkpoint(path)
        self.drafter.load_state_dict(saved["drafter"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.state = saved["state"]
        rng = saved["rng"][self.ctx.rank] if self.ctx.rank < len(saved["rng"]) else None
        if rng is not None:
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
        if self.ctx.is_main:
            print(
                f"[train] resumed at epoch {self.state['epoch']} step "
                f"{self.state['step_in_epoch']} (global step {self.state['global_step']})"
            )

    def _save(self) -> None:
        rng = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        gathered: list[Any] = [rng]
        if self.ctx.enabled:
            gathered = [None] * self.ctx.world_size
            torch.distributed.all_gather_object(gathered, rng)
        if self.ctx.is_main:
            checkpoint.save_checkpoint(
                paths.CHECKPOINTS,
                self.state["global_step"],
                {
                    "fingerprint": self.fingerprint,
                    "drafter": self.drafter.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "state": self.state,
                    "rng": gathered,
                },
                keep=self.config.train.keep_checkpoints,
            )
        barrier(self.ctx)

    # ----------------------------------------------------------------- the loop
    def fit(self) -> None:
        t = self.config.train
        monitor = (
            Monitor(self.config, paths.TRAIN_PLOTS, self.state["rows"])
            if self.ctx.is_main
            else None
        )
        while self.state["epoch"] < t.epochs:
            self._run_epoch(self.state["epoch"], monitor)
            self.state["epoch"] += 1
            self.state["step_in_epoch"] = 0
        self._save()
        summary = self._summary()
        if self.ctx.is_main:
            export_drafter(self.drafter, paths.DRAFTER)
            write_json_atomic(paths.TRAIN_METRICS, summary, sort_keys=True)
            monitor.finish(summary)
            print(f"[train] done: {json.dumps(summary)}")
        barrier(self.ctx)

    def _run_epoch(self, epoch: int, monitor: Monitor | None) -> None:
        c = self.config
        path = epoch_path(paths.PLANS, epoch)
        check_epoch_file(path, self.plan_meta, epoch)
        steps = read_rank_plan(path, self.ctx.rank)
        if len(steps) != self.epoch_steps[epoch]:
            raise StalePlanError(
                f"{path}: rank {self.ctx.rank} has {len(steps)} steps, summary.json says "
                f"{self.epoch_steps[epoch]}; rerun `dflash plan`"
            )
        first = self.state["step_in_epoch"]
        dataset = StepDataset(
            self.store,
            steps,
            first_step=first,
            block_size=c.drafter.block_size,
            anchors_per_sequence=c.drafter.anchors_per_sequence,
            gamma=c.drafter.gamma,
            seed=c.train.seed,
            epoch=epoch,
        )
        loader = make_loader(
            dataset, c.train.num_workers, c.train.prefetch, self.ctx.device.type == "cuda"
        )
        bar = tqdm(
            total=len(steps),
            initial=first,
            desc=f"epoch {epoch + 1}/{c.train.epochs}",
            unit="step",
            disable=not self.ctx.is_main,
            dynamic_ncols=True,
        )
        window = _Window()
        iterator = iter(loader)
        for _ in range(len(dataset)):
            t0 = time.perf_counter()
            micro_batches = next(iterator)
            t1 = time.perf_counter()
            result = self._step(micro_batches)
            t2 = time.perf_counter()
            self.state["step_in_epoch"] += 1
            self.state["global_step"] += 1
            self.state["elapsed_s"] += t2 - t0
            self.state["data_wait_s"] += t1 - t0
            self.state["real_tokens"] += result["real_tokens"]
            self.state["padded_tokens"] += result["padded_tokens"]
            if result["finite"]:
                self.state["epoch_loss"].append((epoch, result["loss"], result["weight"]))
            window.add(result, t2 - t0, t1 - t0)
            bar.update(1)
            bar.set_postfix(loss=f"{result['loss']:.3f}", lr=f"{result['lr']:.2e}")
            step = self.state["global_step"]
            if monitor is not None and (step % c.logging.every == 0 or step == self.total_steps):
                monitor.log(window.row(step, epoch))
                window = _Window()
            if step % c.train.checkpoint_every == 0:
                self._save()
        bar.close()

    def _step(self, micro_batches: list[MicroBatch]) -> dict[str, Any]:
        ctx, c = self.ctx, self.config
        local = torch.tensor(
            [
                sum(mb.weight_sum for mb in micro_batches),
                sum(mb.real_tokens for mb in micro_batches),
                sum(mb.padded_tokens for mb in micro_batches),
                sum(mb.n_samples for mb in micro_batches),
            ],
            dtype=torch.float64,
        )
        weight, real, padded, n_samples = all_reduce_sum(ctx, local).tolist()
        loss_sum = torch.zeros((), dtype=torch.float64)
        correct = torch.zeros(c.drafter.block_size, dtype=torch.float64)
        counted = torch.zeros(c.drafter.block_size, dtype=torch.float64)
        for i, mb in enumerate(micro_batches):
            mb = mb.to(ctx.device)
            last = i == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last or not ctx.enabled else self.model.no_sync()
            with sync:
                with self.autocast:
                    features = target_features(
                        self.target, mb.input_ids, mb.position_ids, mb.document_ids, self.layer_ids
                    )
                    out = dflash_objective(
                        self.model,
                        features,
                        mb.input_ids,
                        mb.loss_mask,
                        mb.document_ids,
                        mb.position_ids,
                        mb.anchors,
                        c.drafter.gamma,
                    )
                # DDP averages gradients over ranks: scaled, the sum is Σ w·CE / Σ_global w.
                (out.loss_sum * (ctx.world_size / max(weight, 1e-12))).backward()
            loss_sum += out.loss_sum.detach().double().cpu()
            correct += out.correct.double().cpu()
            counted += out.counted.double().cpu()
        totals = all_reduce_sum(ctx, torch.cat([loss_sum[None], correct, counted]))
        loss = totals[0].item() / max(weight, 1e-12)
        correct, counted = totals[1 : 1 + c.drafter.block_size], totals[1 + c.drafter.block_size :]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, c.train.clip_grad).item()
        lr = self.scheduler.get_last_lr()[0]
        finite = math.isfinite(loss) and math.isfinite(grad_norm) and weight > 0
        if finite:
            self.optimizer.step()
            self.state["nonfinite_in_a_row"] = 0
        else:
            self.state["skipped_steps"] += 1
            self.state["nonfinite_in_a_row"] += 1
            if self.state["nonfinite_in_a_row"] >= c.train.max_nonfinite_steps:
                raise TrainingError(
                    f"{self.state['nonfinite_in_a_row']} non-finite losses in a row (limit "
                    f"train.max_nonfinite_steps = {c.train.max_nonfinite_steps}) at global step "
                    f"{self.state['global_step']}: lower train.lr or check the data"
                )
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {
            "loss": loss,
            "weight": weight,
            "finite": finite,
            "correct": correct,
            "counted": counted,
            "grad_norm": grad_norm,
            "lr": lr,
            "real_tokens": int(real),
            "padded_tokens": int(padded),
            "n_samples": int(n_samples),
        }

    def _summary(self) -> dict[str, Any]:
        s = self.state
        last_epoch = max((e for e, _, _ in s["epoch_loss"]), default=0)
        last = [(loss, w) for e, loss, w in s["epoch_loss"] if e == last_epoch]
        final_loss = sum(loss * w for loss, w in last) / max(sum(w for _, w in last), 1e-12)
        rows = s["rows"]
        return {
            "final_loss": final_loss,
            "final_accuracy": rows[-1]["accuracy"] if rows else float("nan"),
            "tokens_per_s": s["real_tokens"] / max(s["elapsed_s"], 1e-9),
            "padded_tokens_per_s": s["padded_tokens"] / max(s["elapsed_s"], 1e-9),
            "padding_efficiency": s["real_tokens"] / max(s["padded_tokens"], 1),
            "data_wait_fraction": s["data_wait_s"] / max(s["elapsed_s"], 1e-9),
            "steps": s["global_step"],
            "skipped_steps": s["skipped_steps"],
            "epochs": self.config.train.epochs,
            "world_size": self.ctx.world_size,
            "train_seconds": s["elapsed_s"],
        }


class _Window:
    """Aggregates the steps between two log lines into one row."""

    def __init__(self) -> None:
        self.loss_w = self.weight = self.seconds = self.wait = 0.0
        self.real = self.padded = self.samples = 0
        self.correct = self.counted = None
        self.grad_norm = self.lr = float("nan")

    def add(self, result: dict[str, Any], seconds: float, wait: float) -> None:
        if result["finite"]:
            self.loss_w += result["loss"] * result["weight"]
            self.weight += result["weight"]
        self.correct = (
            result["correct"] if self.correct is None else self.correct + result["correct"]
        )
        self.counted = (
            result["counted"] if self.counted is None else self.counted + result["counted"]
        )
        self.real += result["real_tokens"]
        self.padded += result["padded_tokens"]
        self.samples += result["n_samples"]
        self.seconds += seconds
        self.wait += wait
        self.grad_norm, self.lr = result["grad_norm"], result["lr"]

    def row(self, step: int, epoch: int) -> dict[str, Any]:
        per_position = (self.correct[1:] / self.counted[1:].clamp(min=1)).tolist()
        return {
            "step": step,
            "epoch": epoch,
            "loss": self.loss_w / max(self.weight, 1e-12),
            "accuracy": float(self.correct[1:].sum() / self.counted[1:].sum().clamp(min=1)),
            "per_position_accuracy": per_position,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "tokens_per_s": self.real / max(self.seconds, 1e-9),
            "padded_tokens_per_s": self.padded / max(self.seconds, 1e-9),
            "padding_efficiency": self.real / max(self.padded, 1),
            "mean_sample_length": self.real / max(self.samples, 1),
            "data_wait_fraction": self.wait / max(self.seconds, 1e-9),
        }


NOT_IN_WEIGHTS = ("checkpoint_every", "keep_checkpoints", "num_workers", "prefetch")
"""Train params that change how a run is carried out but not the weights it ends with."""


def run_fingerprint(config: Config, plan_meta: dict[str, Any], manifest: dict[str, Any]) -> str:
    """Everything the trained weights depend on; a checkpoint resumes only into the same run.

    The code that computes the weights and the target's files are part of it: after a fix to
    the objective, DVC reruns training and it must start over, not reuse a finished run.
    """
    c = config.to_dict()
    code = sorted(Path(__file__).parent.glob("*.py")) + sorted(MODEL_CODE.glob("*.py"))
    payload = {
        "drafter": c["drafter"],
        "train": {k: v for k, v in c["train"].items() if k not in NOT_IN_WEIGHTS},
        "plan": plan_meta["meta"],
        "store": manifest,
        "target": {p.name: sha256_file(p) for p in sorted(paths.TARGET.glob("*")) if p.is_file()},
        "code": {p.name: sha256_file(p) for p in code},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def export_drafter(drafter: DFlashDrafter, out: Path) -> None:
    """Write the Hugging Face style drafter directory atomically (tmp dir, then rename)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
