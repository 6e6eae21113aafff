"""The CUDA allocator's settings for training, set in the environment before CUDA starts.

Torch-free, so the launcher can set them before it imports torch, and its ranks inherit them.
"""

from __future__ import annotations

from collections.abc import MutableMapping

ALLOCATOR_SETTINGS = "expandable_segments:True"
"""Segments that grow in place: step shapes vary with every micro-batch, and fixed-size
segments fragment under that until a large block no longer fits although enough is free."""
ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""Where torch reads its allocator settings (the first set wins; the second is the old name)."""


def configure_allocator(environ: MutableMapping[str, str]) -> None:
    """Ask for expandable segments unless the user set the allocator up themselves.

    Torch reads the settings once, when CUDA starts, so this runs before anything touches
    CUDA and also goes into the environment ``torchrun``'s ranks inherit.
    """
    if not any(environ.get(name) for name in ALLOCATOR_VARIABLES):
        environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_SETTINGS
