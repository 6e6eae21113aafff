"""Is ``models/drafter`` the output of the last training run, or left over from an older one?

Training removes ``metrics/train.json`` when it starts and writes it last, after
``metrics/train_details.json`` with the digest of the drafter it exported. A missing file beside a
drafter means a run began and never finished; another digest means the drafter was swapped after the
run. Evaluating either would report figures for weights no one asked for.
"""

from __future__ import annotations

from pathlib import Path

from dflash import paths
from dflash.fingerprint import path_digest
from dflash.metrics_schema import TrainDetails, read


def stale_drafter(root: Path) -> str | None:
    """Why the drafter under ``root`` is not the last training run's, or None when it is.

    Metrics without a digest (written before digests were recorded) prove nothing either way
    and pass.
    """
    if not (root / paths.DRAFTER).is_dir():
        return None
    metrics = root / paths.TRAIN_METRICS
    rerun = "rerun the train stage (`dvc repro train` or `dflash train`)"
    if not metrics.exists():
        return (
            f"{paths.TRAIN_METRICS} is missing: the last training run did not finish, so "
            f"{paths.DRAFTER} is left from an older run; {rerun}"
        )
    details = paths.TRAIN_DETAILS if (root / paths.TRAIN_DETAILS).exists() else paths.TRAIN_METRICS
    train = read(TrainDetails, root / details)
    if isinstance(train, str):
        return f"{details} is unreadable: the last training run did not finish; {rerun}"
    recorded = train.drafter_sha256
    if recorded is not None and recorded != path_digest(root / paths.DRAFTER):
        return (
            f"{paths.DRAFTER} is not the drafter the last training run wrote (its digest "
            f"differs from the one in {details}); {rerun}"
        )
    return None
