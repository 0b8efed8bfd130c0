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


#: the most characters a run name may have (``--run-name``, a recipe's ``name``): one folder name
#: with room for what an automatic run name adds (``-<method>-<YYYYmmdd-HHMMSS>-<n>``)
MAX_NAME_CHARS = 100
#: characters a run name may hold besides letters and digits
NAME_PUNCTUATION = "._-+=@,"
#: what a run name is, for the errors
NAME_RULE = (
    f"a run name is one folder name: at most {MAX_NAME_CHARS} characters, letters, digits and "
    f"'{NAME_PUNCTUATION}' only, not starting with '.' or '-'"
)
#: the longest path a recipe's path keys may hold (Linux's PATH_MAX), in UTF-8 bytes
MAX_PATH_BYTES = 4096
#: the longest single file or folder name in such a path (NAME_MAX of common file systems)
MAX_PART_BYTES = 255


def shown(text: str, most: int = 40) -> str:
    """``text`` quoted for an error line (``repr``: a NUL or newline shows as ``\\x00`` /
    ``\\n``), cut to its first ``most`` characters with its length named when longer."""
    if len(text) <= most:
        return repr(text)
    return f"{text[:most]!r}... ({len(text):,} characters)"


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a run folder (``--run-name``, a recipe's ``name``), or None.

    A run name is a single path component: not empty, not ``.`` / ``..``, no ``/`` or ``\\``, no
    NUL or other control character, not hidden (a leading ``.``) nor flag-like (a leading
    ``-``), at most :data:`MAX_NAME_CHARS` characters, of letters, digits and
    :data:`NAME_PUNCTUATION` only.
    """
    if not name:
        return "is empty"
    if "\x00" in name:
        return "holds a NUL byte"
    if len(name) > MAX_NAME_CHARS:
        return f"is {len(name):,} characters long, over {MAX_NAME_CHARS}"
    if name in (".", ".."):
        return f"is '{name}', a step in a path, not a folder name"
    if "/" in name or "\\" in name:
        return "is a path (it holds '/' or '\\'), not one folder name"
    if name.startswith("."):
        return "starts with '.' (a hidden folder)"
    if name.startswith("-"):
        return "starts with '-' (it would read as a flag)"
    bad = sorted({c for c in name if not (c.isalnum() or c in NAME_PUNCTUATION)})
    if bad:
        more = " and more" if len(bad) > 5 else ""
        return "holds " + ", ".join(repr(c) for c in bad[:5]) + more
    return None


def safe_name(text: str) -> str:
    """``text`` made into a run name that :func:`name_problem` accepts (for a name derived from
    something else, e.g. a checkpoint folder's): each run of other characters becomes ``-``,
    leading ``.`` / ``-`` go, cut to :data:`MAX_NAME_CHARS`; ``run`` when nothing is left."""
    out = "".join(c if c.isalnum() or c in NAME_PUNCTUATION else "-" for c in text)
    while "--" in out:
        out = out.replace("--", "-")
    out = out.lstrip(".-")[:MAX_NAME_CHARS].rstrip(".-")
    return out if out and name_problem(out) is None else "run"


def path_problem(path: str) -> str | None:
    """Why ``path`` cannot be a file or folder path of a recipe key (``train.output_dir``,
    ``data.source``, ``data.tokenizer``, ``data.cache_dir``, ``model.pretrained``), or None:
    empty, a NUL or other control character, over :data:`MAX_PATH_BYTES` bytes, or a name in
    it over :data:`MAX_PART_BYTES` bytes (no file system holds it)."""
    if not path.strip():
        return "is empty"
    if "\x00" in path:
        return "holds a NUL byte"
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        return "holds a control character (a newline, tab, ...)"
    size = len(path.encode("utf-8", errors="surrogatepass"))
    if size > MAX_PATH_BYTES:
        return f"is {size:,} bytes long, over the {MAX_PATH_BYTES:,} a path may have"
    for part in path.replace("\\", "/").split("/"):
        if len(part.encode("utf-8", errors="surrogatepass")) > MAX_PART_BYTES:
            return (
                f"holds the name {shown(part, 20)}, over the {MAX_PART_BYTES} bytes a file "
                "system takes for one name"
            )
    return None
