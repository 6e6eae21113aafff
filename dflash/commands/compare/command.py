"""``dflash compare [EXP ...] [--json]``: which run is better, and is the difference real?

Each run's per-prompt τ and training figures are read from its own revision
(:mod:`dflash.commands.compare.revisions`); runs differing only in their seeds are pooled; every
later
group is compared with the first (:mod:`dflash.commands.compare.paired`). A run named twice, or
runs of
one setting only, leave nothing to compare: exit status 2, saying which.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash.commands.compare.paired import compare, one_setting, pool, same_run
from dflash.commands.compare.revisions import runs_to_compare
from dflash.commands.compare.screen import as_json, render
from dflash.errors import UserError


def run(args: argparse.Namespace, root: Path) -> int:
    try:
        runs = runs_to_compare(root, args.runs)
    except UserError as err:
        print(f"dflash compare: {err}", file=sys.stderr)
        return 2
    groups = pool(runs)
    why = same_run(runs) or (None if len(groups) > 1 else one_setting(runs))
    if why:
        print(f"dflash compare: {why}: nothing to compare", file=sys.stderr)
        return 2
    first, others = groups[0], groups[1:]
    comparisons = [(group, *compare(first, group)) for group in others]
    if args.json:
        print(json.dumps(as_json(first, comparisons), indent=2, allow_nan=False))
    else:
        sys.stdout.write(render(first, comparisons))
    return 0
