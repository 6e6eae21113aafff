"""``python -m dflash.publish DIR``: the drafter export with its scorecard, ready to share.

``models/drafter`` is the train stage's output, written before anything scored it, so its
model card cannot hold τ. This copies the export to ``DIR`` (whole or not at all) and adds
to its card the scorecard of ``metrics/eval_details.json``: every prompt set and stratum. It first
checks that evaluation scored these very weights, and refuses otherwise (exit 2).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from dflash.errors import DirectoryInUse, UserError
from dflash.fileio import atomic_dir, exit_on_sigterm, require_only
from dflash.fingerprint import path_digest
from dflash.freshness import stale_drafter
from dflash.metrics_schema import EvalDetails
from dflash.model import hf_files
from dflash.model.card import SCORECARD_HEADING, SCORECARD_NOTE, scorecard_section
from dflash.workspace import Workspace

NAMES = Workspace()
"""The workspace's paths relative to its root."""

EXPORT_FILES = (hf_files.CONFIG, hf_files.WEIGHTS, hf_files.REMOTE_CODE, hf_files.MODEL_CARD)
"""What an export holds, hence a previous publish (with any other file the export now holds)."""


def scored_metrics(root: Path) -> EvalDetails:
    """The evaluation details under ``root``, when they scored the drafter there; else why not."""
    rerun = "rerun the evaluate stage (`dvc repro evaluate` or `dflash evaluate`)"
    stale = stale_drafter(root)
    if stale:
        raise UserError(stale)
    try:
        metrics = EvalDetails.model_validate_json((root / NAMES.eval_details).read_text())
    except FileNotFoundError:
        raise UserError(f"{NAMES.eval_details} is missing: {rerun}") from None
    except ValueError:  # not JSON, or not the file evaluate writes
        raise UserError(f"{NAMES.eval_details} is unreadable: {rerun}") from None
    if metrics.drafter_sha256 != path_digest(root / NAMES.drafter):
        raise UserError(f"{NAMES.eval_details} scored other weights than {NAMES.drafter}: {rerun}")
    return metrics


def publish(root: Path, out: Path) -> None:
    """Copy the scored export with its scorecard to ``out``, whole or not at all.

    ``out`` must be absent, empty or a previous publish (:func:`require_publish_or_empty`)."""
    source = root / NAMES.drafter
    require_publish_or_empty(out, root)
    metrics = scored_metrics(root)
    from dflash.eval.strata import scorecard_rows  # imports torch: not for --help or a refusal

    table = scorecard_rows(metrics)
    card = (source / hf_files.MODEL_CARD).read_text().replace(SCORECARD_NOTE, "")
    with atomic_dir(out) as tmp:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        (tmp / hf_files.MODEL_CARD).write_text(f"{card}\n{scorecard_section(table)}")


def require_publish_or_empty(out: Path, root: Path) -> None:
    """Refuse (``DirectoryInUse``) an ``out`` whose replacement could lose anything.

    Beside the workspace's own directories and links (``fileio.misnamed``), a non-empty
    directory is taken only when it holds the files of an export and nothing else, with a
    card that carries a scorecard: what this command wrote there before. The ``.tmp`` and
    ``.old`` directories the swap uses beside ``out`` may hold export files only.
    """
    source = root / NAMES.drafter
    names = set(EXPORT_FILES)
    if source.is_dir():
        names.update(p.name for p in source.iterdir())
    require_only(out, sorted(names), workspace=root)
    for scratch in (out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")):
        require_only(scratch, sorted(names))
    if out.is_dir() and any(out.iterdir()) and not _has_scorecard(out / hf_files.MODEL_CARD):
        raise DirectoryInUse(
            f"{out}: holds drafter files but no published card ({SCORECARD_HEADING} in "
            f"{hf_files.MODEL_CARD}), so it is not a previous publish; nothing was written"
        )


def _has_scorecard(card: Path) -> bool:
    try:
        return SCORECARD_HEADING in card.read_text(errors="replace").splitlines()
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash.publish", description=__doc__)
    parser.add_argument(
        "out",
        type=Path,
        help="directory to write: absent, empty, or a previous publish (replaced whole)",
    )
    parser.add_argument("--root", type=Path, default=Path("."), help="the pipeline's directory")
    args = parser.parse_args(argv)
    try:
        with exit_on_sigterm():
            publish(args.root, args.out)
    except (UserError, FileNotFoundError) as err:
        print(f"dflash publish: {err}", file=sys.stderr)
        return 2
    print(f"dflash publish: {args.root / NAMES.drafter} and its scorecard -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
