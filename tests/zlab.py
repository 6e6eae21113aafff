"""z-lab's reference model code (``dflash/model.py`` of their ``dflash`` wheel), loaded from the
wheel ``make setup`` downloads. It is never installed: its import name is this project's too."""

from __future__ import annotations

import sys
import types
import zipfile
from pathlib import Path

WHEEL = Path(sys.prefix) / "reference" / "dflash-0.1.0-py3-none-any.whl"
NAME = "zlab_dflash_model"


def reference_model() -> types.ModuleType:
    """The wheel's ``dflash/model.py`` as the module ``zlab_dflash_model``."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    if not WHEEL.exists():
        raise FileNotFoundError(
            f"{WHEEL} is missing: `make setup` downloads it (tests/reference.txt)"
        )
    with zipfile.ZipFile(WHEEL) as wheel:
        source = wheel.read("dflash/model.py")
    module = types.ModuleType(NAME)
    module.__file__ = f"{WHEEL}/dflash/model.py"
    sys.modules[NAME] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module
