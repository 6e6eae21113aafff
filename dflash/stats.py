"""``python -m dflash.stats``: length statistics and bucket boundaries of any lengths file."""

import sys

from dflash.batching.stats import main

if __name__ == "__main__":
    sys.exit(main())
