"""What the launching process checks once, before any rank starts.

A stale plan, a world size the plans were not made for, more ranks than GPUs, or a starting
checkpoint made for another target would otherwise be found by every rank at once: the same
message printed N times, then torchrun's traceback.

The checks read files only, so the model code is imported where a check needs it: the
launcher starts torchrun a second sooner than with transformers' modelling imported.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from dflash.batching.io import read_plan_meta
from dflash.config.schema import Config
from dflash.data.store import TokenStore
from dflash.errors import ConfigError
from dflash.model.layer_ids import check_layer_selection
from dflash.model.target_dir import resolve_target_path, weights_bytes
from dflash.train.distributed.ranks import processes
from dflash.train.plan_check import check_plan
from dflash.train.run_files import TrainFiles

logger = logging.getLogger(__name__)


def preflight(config: Config, files: TrainFiles, nnodes: int = 1) -> None:
    """Raise a user error (exit 2) for a run that cannot go well; warn for a slow one.
    Capacity is this node's: its share of the job's ranks over ``nnodes`` nodes."""
    if files.target.exists():  # drafter.* changes rerun train, not the target stage's check
        check_drafter(config, files)
    plan, store = read_plan_meta(files.plans), TokenStore(files.tokenized)
    check_plan(plan, store, config, config.train.world_size, files.plans)
    t = config.train
    target = Path(resolve_target_path(files.target)) if files.target.exists() else None
    if t.features == "files" or t.topology == "engine":
        check_features(config, files, len(store))
    if t.topology == "decoupled":
        check_capacity(processes(t) // nnodes, "train.world_size + train.target_ranks", target)
    else:
        check_capacity(t.world_size // nnodes, target=target)


def check_features(config: Config, files: TrainFiles, samples: int) -> None:
    """Features from files need the capture stage's, of the drafter's layers (and the last
    hidden state where the objective distills), all there, of the token store's ``samples``
    and of this target; from engines, a reader for ``engine.backend`` (hs-connectors, and
    Mooncake's package for mooncake)."""
    from dflash.features.capture import target_geometry
    from dflash.features.engine_client import hidden_transfer
    from dflash.features.feature_files import check_capture, check_files, distills

    if config.train.features == "files":
        geometry = target_geometry(config.drafter, files.target, files.init)
        check_capture(files.features, *geometry, last=distills(config), config=config)
        check_files(files.features, samples, files.target)
    else:
        hidden_transfer(config.engine.backend, files.hidden_states)


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
    from dflash.data.tokenizer import load_tokenizer
    from dflash.train.init_drafter import checked_checkpoint, target_shape

    shape = target_shape(target_config, load_tokenizer(files.tokenizer))
    checked_checkpoint(d, files.init, shape)


RANKS_PER_CORE = 4
"""CPU ranks beyond this many per core only wait on each other: refused, not just slow."""


def check_capacity(processes: int, what: str = "train.world_size", target: Path | None = None):
    """One rank per visible GPU; on CPU, at most ``RANKS_PER_CORE`` per core (a warning past
    one per core), and no more target copies than host memory holds."""
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if processes > gpus:
            raise ConfigError(
                f"{what} = {processes} but {gpus} GPU(s) are visible: each rank needs "
                "its own; lower train.world_size (then rerun `dflash plan`) or expose more GPUs"
            )
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    if processes > RANKS_PER_CORE * cores:
        raise ConfigError(
            f"{what} = {processes} ranks, but this machine runs at most "
            f"{RANKS_PER_CORE * cores} ({RANKS_PER_CORE} per CPU core, {cores} cores)"
        )
    if target is not None:
        check_memory(processes, what, target)
    if processes > cores:
        logger.warning(
            f"{what} = {processes} ranks on {cores} CPU core(s): they will share cores and "
            "run slower than fewer ranks would"
        )


def check_memory(processes: int, what: str, target: Path) -> None:
    """Every CPU rank holds the target's weights: refuse a job whose copies exceed RAM."""
    weights = weights_bytes(target)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if processes * weights > memory:
        fits = max(memory // max(weights, 1), 1)
        raise ConfigError(
            f"{what} = {processes} ranks each holding the target ({weights / 2**30:.1f} GiB) "
            f"need more than this machine's {memory / 2**30:.0f} GiB of memory: at most "
            f"{fits} ranks fit"
        )
