"""The capture stage: the target's features of every training sample, written once
(:mod:`dflash.train.capture`), and the held-out τ batch; only a manifest unless
``train.features`` is files."""

from __future__ import annotations

from dflash.config import Config
from dflash.train.capture import capture
from dflash.workspace import Workspace


def run(config: Config, workspace: Workspace) -> None:
    init = config.drafter.init_from
    capture(
        config,
        workspace.tokenized,
        workspace.target,
        workspace.features,
        None if init is None else workspace.root / init,
        workspace.heldout,
        workspace.tokenizer,
    )
