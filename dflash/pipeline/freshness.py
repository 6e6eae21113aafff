"""Is ``models/drafter`` the output of the last training run, or left over from an older one?

Training removes ``metrics/train.json`` when it starts and writes it last, after
``metrics/train_details.json`` with the digest of the drafter it exported. A missing file beside a
drafter means a run began and never finished; another digest means the drafter was swapped after the
run. Evaluating either would report figures for weights no one asked for.
"""

from __future__ import annotations

from pathlib import Path

from dflash.metrics.schema import TrainDetails, read
from dflash.pipeline.fingerprint import path_digest
from dflash.pipeline.workspace import RELATIVE

SHOWN = 16
"""Hex digits of a digest a message shows: enough to tell two apart."""


def stale_drafter(root: Path) -> str | None:
    """Why the drafter under ``root`` is not the last training run's, or None when it is.

    Metrics without a digest (written before digests were recorded) prove nothing either way
    and pass.
    """
    if not (root / RELATIVE.drafter).is_dir():
        return None
    metrics = root / RELATIVE.train_metrics
    rerun = "rerun the train stage (`dvc repro train` or `dflash train`)"
    if not metrics.exists():
        return (
            f"{RELATIVE.train_metrics} is missing: the last training run did not finish, so "
            f"{RELATIVE.drafter} is left from an older run; {rerun}"
        )
    details = (
        RELATIVE.train_details
        if (root / RELATIVE.train_details).exists()
        else RELATIVE.train_metrics
    )
    train = read(TrainDetails, root / details)
    if isinstance(train, str):
        return f"{details} is unreadable: the last training run did not finish; {rerun}"
    recorded = train.drafter_sha256
    if recorded is None:
        return None
    found = path_digest(root / RELATIVE.drafter)
    if recorded != found:
        return (
            f"{RELATIVE.drafter} is not the drafter the last training run wrote (its digest "
            f"begins {found[:SHOWN]}, the one {details} records begins {recorded[:SHOWN]}); "
            f"{rerun}"
        )
    return None
