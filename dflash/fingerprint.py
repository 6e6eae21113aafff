"""The one way to fingerprint what an output was made from: values, files, directories.

Resumable work (regenerate shards, training checkpoints) and records of provenance (a plan's
lengths, a tokenizer, a target's architecture) all compare SHA-256 digests made here, so
"same inputs" means one thing across the project: the same bytes, not the same counts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dflash.fileio import sha256_file


def digest(value: Any) -> str:
    """SHA-256 of ``value``: raw ``bytes`` as they are, anything else as canonical JSON."""
    if not isinstance(value, bytes):
        value = json.dumps(value, sort_keys=True, default=str).encode()
    return hashlib.sha256(value).hexdigest()


def path_digest(path: str | Path) -> str:
    """SHA-256 over the contents of a file, or of every file under a directory with its name.

    Names count: a file renamed inside a directory changes the digest. A missing path has
    the digest of nothing, so a run without it differs from one with it.
    """
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    return digest({str(f.relative_to(path)): sha256_file(f) for f in files})
