"""Is ``models/drafter`` the output of the last training run, or left over from an older one?

Training removes ``metrics/train.json`` when it starts and writes it last, after
``metrics/train_details.json`` with the digest of the drafter it exported. A missing file beside a
drafter means a run began and never finished; another digest means the drafter was swapped after the
run. Evaluating either would report figures for weights no one asked for.
"""

from __future__ import annotations

from pathlib import Path

from dflash.fingerprint import path_digest
from dflash.metrics_schema import TrainDetails, read
from dflash.workspace import Workspace

NAMES = Workspace()
"""The workspace's paths relative to its root: how the messages name them."""


def stale_drafter(root: Path) -> str | None:
    """Why the drafter under ``root`` is not the last training run's, or None when it is.

    Metrics without a digest (written before digests were recorded) prove nothing either way
    and pass.
    """
    if not (root / NAMES.drafter).is_dir():
        return None
    metrics = root / NAMES.train_metrics
    rerun = "rerun the train stage (`dvc repro train` or `dflash train`)"
    if not metrics.exists():
        return (
            f"{NAMES.train_metrics} is missing: the last training run did not finish, so "
            f"{NAMES.drafter} is left from an older run; {rerun}"
        )
    details = NAMES.train_details if (root / NAMES.train_details).exists() else NAMES.train_metrics
    train = read(TrainDetails, root / details)
    if isinstance(train, str):
        return f"{details} is unreadable: the last training run did not finish; {rerun}"
    recorded = train.drafter_sha256
    if recorded is not None and recorded != path_digest(root / NAMES.drafter):
        return (
            f"{NAMES.drafter} is not the drafter the last training run wrote (its digest "
            f"differs from the one in {details}); {rerun}"
        )
    return None
