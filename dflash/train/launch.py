"""``dflash train``: run under ``torchrun`` when it launched us, otherwise launch it.

``dvc repro`` runs ``torchrun --standalone --nproc_per_node N stages/train.py`` itself; a
user typing ``dflash train`` gets the same thing with the resolved params handed over in a
temporary file, so ``--set`` overrides reach every rank.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from dflash import paths
from dflash.config import Config, unwrap
from dflash.model.layer_ids import check_layer_selection, target_depth
from dflash.model.target import resolve_target_path
from dflash.train.distributed import launched_by_torchrun


def check_target_features(config: Config) -> None:
    """The layer selection against the target built, before any rank starts: a params error
    (exit 2), not a traceback from every rank."""
    if paths.TARGET.exists():
        depth = target_depth(resolve_target_path(paths.TARGET), 0)
        check_layer_selection(depth, config.drafter.num_target_features)


def run(config: Config) -> int:
    check_target_features(config)
    if launched_by_torchrun() or config.train.world_size == 1:
        from dflash.train.loop import train

        train(config)
        return 0
    plain = json.loads(json.dumps(unwrap(config).to_dict()))
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(plain, f)
    params = Path(f.name)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={config.train.world_size}",
        "-m",
        "dflash.train.launch",
        "--params",
        str(params),
    ]
    try:
        return subprocess.call(cmd)
    finally:
        params.unlink(missing_ok=True)


if __name__ == "__main__":
    from dflash.cli import stage_main

    sys.exit(stage_main("train"))
