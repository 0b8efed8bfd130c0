"""Where an output can go: checks made before any work, so a bad path costs nothing."""

from __future__ import annotations

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


#: advisory lock file of a run directory, held by the process that trains into it
#: (:func:`poetxq.train.lock_run_dir`); not a run output
RUN_LOCK = ".poetxq.lock"
