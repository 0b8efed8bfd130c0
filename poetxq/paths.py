"""Where an output can go: checks made before any work, so a bad path costs nothing."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def nearest_existing(path: Path) -> Path:
    """``path`` itself if it exists, else the closest folder above it that does (absolute)."""
    anchor = path.absolute()
    while not anchor.exists() and anchor != anchor.parent:
        anchor = anchor.parent
    return anchor


def writable_dir(path: Path) -> bool:
    """Whether files can be created in ``path``: a directory this user may write and enter on a
    file system mounted read-write, where a file can really be made (``/proc`` passes the
    permission check for root but takes no new files): a temporary file is created and
    removed."""
    if not (path.is_dir() and os.access(path, os.W_OK | os.X_OK)):
        return False
    try:
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


def unwritable_reason(path: Path) -> str | None:
    """Why no folder can be made at ``path`` (None where it can): the nearest existing folder
    (:func:`nearest_existing`) is a file (``"'/x' is a file, not a directory"``), or it cannot
    be written (``"'/x' is read-only or not writable by this user"``)."""
    anchor = nearest_existing(path)
    if anchor.exists() and not anchor.is_dir():
        return f"'{anchor}' is a file, not a directory"
    if not writable_dir(anchor):
        return f"'{anchor}' is read-only or not writable by this user"
    return None


#: advisory lock file of a run directory, held by the process that trains into it
#: (:func:`poetxq.training.rundir.lock_run_dir`); not a run output
RUN_LOCK = ".poetxq.lock"


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 16 MiB chunks (checkpoint and corpus manifests)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()
