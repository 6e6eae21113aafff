"""``python -m dflash.commands.publish DIR``: the drafter export with its scorecard, ready to share.

``models/drafter`` is the train stage's output, written before anything scored it, so its
model card cannot hold τ. This copies the export to ``DIR`` (whole or not at all) and adds
to its card the scorecard of ``metrics/eval_details.json``: every prompt set and stratum. It first
checks that evaluation scored these very weights, both its files whole and in agreement, and
refuses otherwise (exit 2).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from dflash.errors import DirectoryInUse, UserError
from dflash.eval.outputs import eval_headline
from dflash.fileio import atomic_dir, exit_on_sigterm, require_only
from dflash.metrics.schema import EvalDetails, EvalHeadline, M, flaw
from dflash.model import hf_files
from dflash.model.card import SCORECARD_HEADING, SCORECARD_NOTE, scorecard_section
from dflash.pipeline.fingerprint import path_digest
from dflash.pipeline.freshness import stale_drafter
from dflash.pipeline.workspace import RELATIVE

EXPORT_FILES = (hf_files.CONFIG, hf_files.WEIGHTS, hf_files.REMOTE_CODE, hf_files.MODEL_CARD)
"""What an export holds, hence a previous publish (with any other file the export now holds)."""


RERUN = "rerun the evaluate stage (`dvc repro evaluate` or `dflash evaluate`)"


def scored_metrics(root: Path) -> EvalDetails:
    """The evaluation details under ``root``, when they and the headline ``dvc exp show``
    reads scored the drafter there; else why not."""
    if not (root / RELATIVE.drafter).is_dir():
        raise UserError(
            f"{RELATIVE.drafter} is missing: run the train stage (`dvc repro train` or "
            "`dflash train`), then evaluate"
        )
    stale = stale_drafter(root)
    if stale:
        raise UserError(stale)
    metrics = load(root, EvalDetails, RELATIVE.eval_details)
    if metrics.drafter_sha256 != path_digest(root / RELATIVE.drafter):
        raise UserError(
            f"{RELATIVE.eval_details} scored other weights than {RELATIVE.drafter}: {RERUN}"
        )
    shown = load(root, EvalHeadline, RELATIVE.eval_metrics)
    if shown.dump() != eval_headline(metrics).dump():
        raise UserError(f"{RELATIVE.eval_metrics} does not match {RELATIVE.eval_details}: {RERUN}")
    return metrics


def load(root: Path, model: type[M], rel: Path) -> M:
    """The file ``rel`` under ``root`` as ``model``, whole; refused when missing or not so."""
    path = root / rel
    if not path.exists():
        raise UserError(f"{rel} is missing: {RERUN}")
    why = flaw(model, path)
    if why:
        raise UserError(f"{rel} is unreadable ({why}): {RERUN}")
    return model.model_validate_json(path.read_bytes())


def publish(root: Path, out: Path) -> None:
    """Copy the scored export with its scorecard to ``out``, whole or not at all.

    ``out`` must be absent, empty or a previous publish (:func:`require_publish_or_empty`)."""
    source = root / RELATIVE.drafter
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
    source = root / RELATIVE.drafter
    names = set(EXPORT_FILES)
    if source.is_dir():
        names.update(p.name for p in source.iterdir())
    require_only(out, sorted(names), workspace=root)
    scratch = [out.with_name(out.name + suffix) for suffix in (".tmp", ".old")]
    for directory in scratch:
        require_only(directory, sorted(names))
    for directory in (out, *scratch):
        strangers = nested_strangers(directory, source)
        if strangers:
            raise DirectoryInUse(
                f"{directory} holds {', '.join(strangers[:3])}, which this writer did not make; "
                "it replaces the directory whole, so give it an empty or own directory"
            )
    if out.is_dir() and any(out.iterdir()) and not _has_scorecard(out / hf_files.MODEL_CARD):
        raise DirectoryInUse(
            f"{out}: holds drafter files but no published card ({SCORECARD_HEADING} in "
            f"{hf_files.MODEL_CARD}), so it is not a previous publish; nothing was written"
        )


def nested_strangers(directory: Path, source: Path) -> list[str]:
    """The paths inside ``directory``'s subdirectories that the export ``source`` does not
    hold: a publish copies the export's subdirectories whole, so anything else there was put
    by hand. (``require_only`` checks the top level by name.)"""
    found = []
    for here, dirs, files in os.walk(directory):
        rel = Path(here).relative_to(directory)
        if rel != Path("."):
            found += [str(rel / n) for n in dirs + files if not os.path.lexists(source / rel / n)]
    return sorted(found)


def _has_scorecard(card: Path) -> bool:
    try:
        return SCORECARD_HEADING in card.read_text(errors="replace").splitlines()
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash.commands.publish", description=__doc__)
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
    print(f"dflash publish: {args.root / RELATIVE.drafter} and its scorecard -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
