"""DVC stage `ingest`: parses --params/--set and calls the library (see dflash.cli.STAGES)."""

import os
import sys

# Python puts this folder first on sys.path, where tokenize.py would shadow the standard
# library module of that name; the stage scripts import nothing from here.
sys.path = [p for p in sys.path if os.path.abspath(p) != os.path.dirname(os.path.abspath(__file__))]

from dflash.cli import stage_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(stage_main("ingest"))
