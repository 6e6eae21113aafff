"""The one way to fingerprint what an output was made from: values, files, directories.

Resumable work (regenerate shards, training checkpoints) and records of provenance (a plan's
lengths, a tokenizer, a target's architecture) all compare SHA-256 digests made here, so
"same inputs" means one thing across the project: the same bytes, not the same counts.
A :class:`DigestCache` spares rereading files that have not changed since they were hashed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dflash.fileio import sha256_file, write_json_atomic


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


class DigestCache:
    """Files' SHA-256, kept in a JSON file by what any rewrite or copy of a file changes.

    The key is the file's device, inode, size, modification time and status-change time: a
    copy gets a new inode whatever times it keeps (``cp -r``, ``tar``, ``rsync``, ``dvc
    checkout`` may drop sub-second ones), and a file rewritten in place a new ctime even when
    its mtime is set back, which no tool can do to a ctime. Either is read again, not trusted.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            entries = {}
        self.entries: dict[str, Any] = entries if isinstance(entries, dict) else {}
        self.changed = False

    def file(self, path: str | Path) -> str:
        """``path``'s SHA-256, read again only when its key changed."""
        stat = Path(path).stat()
        key = [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
        known = self.entries.get(str(path))
        if isinstance(known, list) and len(known) == 2 and known[0] == key:
            return known[1]
        sha = sha256_file(path)
        self.entries[str(path)] = [key, sha]
        self.changed = True
        return sha

    def save(self) -> None:
        """Write the entries back when any changed, less those of files that are gone."""
        if not self.changed:
            return
        kept = {name: entry for name, entry in self.entries.items() if Path(name).is_file()}
        write_json_atomic(self.path, kept, sort_keys=True)
        self.changed = False
