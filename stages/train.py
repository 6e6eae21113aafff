"""DVC stage `train`: see dflash.cli.STAGES for the library function it calls."""

import sys

from dflash.cli import stage_main

if __name__ == "__main__":
    sys.exit(stage_main("train"))
