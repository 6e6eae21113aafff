"""DVC stage `capture`: parses --params/--set and calls the library (declared in dvc.yaml)."""

import sys

from dflash.cli import stage_main

if __name__ == "__main__":
    sys.exit(stage_main("capture"))
