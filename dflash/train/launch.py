"""``dflash train``: run under ``torchrun`` when it launched us, otherwise launch it.

``dvc repro`` runs ``torchrun --standalone --nproc_per_node N stages/train.py`` itself; a
user typing ``dflash train`` gets the same thing with the resolved params handed over in a
temporary file, so ``--set`` overrides reach every rank.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from dflash.config import Config
from dflash.declaration import whole
from dflash.train.distributed import launched_by_torchrun


def run(config: Config) -> int:
    if launched_by_torchrun() or config.train.world_size == 1:
        from dflash.train.loop import train

        train(config)
        return 0
    plain = whole(config).model_dump(mode="json")
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
        "dflash.cli",
        "train",
        "--params",
        str(params),
    ]
    try:
        return subprocess.call(cmd)
    finally:
        params.unlink(missing_ok=True)
