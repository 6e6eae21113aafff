"""The ingest stage: ``data.source`` in, both splits and the report in ``data/ingested``."""

from __future__ import annotations

import json
import logging

from dflash.config.schema import Config
from dflash.data.ingest import NoConversationsError, ingest, open_source
from dflash.fileio import atomic_dir, write_json_atomic
from dflash.metrics.schema import IngestReport
from dflash.pipeline.workspace import Workspace

logger = logging.getLogger(__name__)


def run(config: Config, workspace: Workspace) -> int:
    """Read ``data.source`` and write both splits and the report under ``data/ingested``."""
    w = workspace
    source = config.data.source
    records, extra = open_source(source, (w.raw, w.dvc_cache))
    try:
        with atomic_dir(w.ingested) as out:
            d = config.data
            train, heldout = out / w.conversations.name, out / w.heldout.name
            report = ingest(records, train, heldout, d.eval_fraction, d.max_conversations)
            report = {"source": source, **report, **extra}
            if report["kept"]["train"] == 0:
                raise NoConversationsError(report)
            shown = IngestReport.model_validate(report).dump()
            write_json_atomic(out / w.ingest_report.name, shown)
    except NoConversationsError as err:
        logger.error(f"{err}; nothing written. Report:\n{json.dumps(err.report, indent=2)}")
        return 1
    logger.info(
        f"{source}: read {report['records_read']}, train {report['kept']['train']}, "
        f"heldout {report['kept']['heldout']}, skipped {report['skipped_total']}, "
        f"duplicates {report['duplicates_removed']['count']}, "
        f"left out by max_conversations {report['left_out_by_max_conversations']}"
    )
    return 0
