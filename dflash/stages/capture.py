"""The capture stage: the target's features of every training sample, written once
(:mod:`dflash.features.capture`), and the held-out τ batch; only a manifest unless
``train.features`` is files. The manifest records the stage's params, so a training run that
refuses the files names the ones it holds otherwise."""

from __future__ import annotations

from dflash.config.schema import Config
from dflash.features.capture import capture
from dflash.pipeline.declaration import declared_params, restrict, stages, unrestricted
from dflash.pipeline.workspace import Workspace


def run(config: Config, workspace: Workspace) -> None:
    init = config.drafter.init_from
    declared = declared_params(restrict(unrestricted(config), stages()["capture"].params))
    params = {
        f"{name}.{key}": value for name, keys in declared.items() for key, value in keys.items()
    }
    capture(
        config,
        workspace.tokenized,
        workspace.target,
        workspace.features,
        None if init is None else workspace.root / init,
        workspace.heldout,
        workspace.tokenizer,
        params,
        workspace.hidden_states,
    )
