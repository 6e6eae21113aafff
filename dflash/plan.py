"""``python -m dflash.plan``: plan any lengths file; ``python -m dflash.plan validate DIR``."""

import sys

from dflash.batching.plan import main

if __name__ == "__main__":
    sys.exit(main())
