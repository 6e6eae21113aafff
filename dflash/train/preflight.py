"""What the launching process checks once, before any rank starts.

A stale plan, a world size the plans were not made for, more ranks than GPUs, or a starting
checkpoint made for another target would otherwise be found by every rank at once: the same
message printed N times, then torchrun's traceback.
"""

from __future__ import annotations

import logging
import os

import torch

from dflash.batching.io import read_plan_meta
from dflash.config import Config
from dflash.data.store import TokenStore
from dflash.data.tokenizer import load_tokenizer
from dflash.errors import ConfigError
from dflash.model.layer_ids import check_layer_selection
from dflash.model.load import resolve_target_path
from dflash.train.files import TrainFiles
from dflash.train.init_drafter import checked_checkpoint, target_shape
from dflash.train.plan_check import check_plan
from dflash.train.topology import processes

logger = logging.getLogger(__name__)


def preflight(config: Config, files: TrainFiles) -> None:
    """Raise a user error (exit 2) for a run that cannot go well; warn for a slow one."""
    if files.target.exists():  # drafter.* changes rerun train, not the target stage's check
        check_drafter(config, files)
    check_plan(
        read_plan_meta(files.plans), TokenStore(files.tokenized), config, config.train.world_size
    )
    t = config.train
    if t.topology == "decoupled":
        check_capacity(processes(t), "train.world_size + train.target_ranks")
    else:
        check_capacity(t.world_size)


def check_drafter(config: Config, files: TrainFiles) -> None:
    """The drafter's layer selection, or the checkpoint it starts from, against the target's
    config and the tokenizer (no weights are loaded)."""
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(
        resolve_target_path(files.target), local_files_only=True
    )
    depth = target_config.get_text_config().num_hidden_layers
    d = config.drafter
    if files.init is None:
        check_layer_selection(depth, d.num_target_features)
        return
    shape = target_shape(target_config, load_tokenizer(files.tokenizer))
    checked_checkpoint(d, files.init, shape)


def check_capacity(world_size: int, what: str = "train.world_size") -> None:
    """One rank per visible GPU; on CPU, more ranks than cores only share them (a warning)."""
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if world_size > gpus:
            raise ConfigError(
                f"{what} = {world_size} but {gpus} GPU(s) are visible: each rank needs "
                "its own; lower train.world_size (then rerun `dflash plan`) or expose more GPUs"
            )
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if world_size > (cores or 1):
        logger.warning(
            f"train.world_size = {world_size} ranks on {cores} CPU "
            "core(s): they will share cores and run slower than fewer ranks would"
        )
