"""What every source has in common: :class:`Source` (a resolved source, its documents and the
identity that keys the token cache) and the text helpers the readers share."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poetxq.data.config import DataError

CHUNK_CHARS = 8000  # target document size when long texts are cut at blank lines


@dataclass
class Source:
    """A resolved source. Resolving is cheap (no text is read) so it can key the cache."""

    description: str
    identity: dict[str, Any]
    # Either one document stream (split by document hash) or predefined train/val streams.
    documents: Callable[[], Iterator[str]] | None = None
    train_documents: Callable[[], Iterator[str]] | None = None
    val_documents: Callable[[], Iterator[str]] | None = None

    @property
    def predefined_split(self) -> bool:
        return self.documents is None


def package_dir(module: str, pip_cmd: str, purpose: str) -> Path:
    """Folder of an installed package found with find_spec (the package is not imported)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        dist = pip_cmd.split()[-1].split("==")[0]
        raise DataError(f"{purpose} needs the '{dist}' package: {pip_cmd}")
    return Path(next(iter(spec.submodule_search_locations)))


def chunk_text(text: str, max_chars: int = CHUNK_CHARS) -> list[str]:
    """Cut text at blank lines into pieces of at most about ``max_chars`` characters.

    A single paragraph longer than ``max_chars`` stays whole.
    """
    text = text.strip()
    if len(text) <= max_chars:
        return [text] if text else []
    paragraphs = [p.strip() for p in re.split(r"\n[ \t]*\n", text)]
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for para in paragraphs:
        if not para:
            continue
        if current and size + len(para) + 2 > max_chars:
            chunks.append("\n\n".join(current))
            current, size = [], 0
        current.append(para)
        size += len(para) + 2
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def record_text(rec: Any, field_name: str, where: str) -> str | None:
    """The text of one record (a JSON object, a dataset row), None when the field is null."""
    if not isinstance(rec, dict):
        raise DataError(
            f"{where} is a {type(rec).__name__}, not a JSON object; records must be objects "
            f"with a '{field_name}' field"
        )
    if field_name not in rec:
        raise DataError(
            f"{where} has no text field '{field_name}'; fields present: "
            f"{', '.join(map(str, rec)) or '(none)'}; "
            "set --text-field (data.text_field) to the field with the text"
        )
    value = rec[field_name]
    if value is None:
        return None
    if isinstance(value, (list, dict)):  # a wrapper object: {"data": [{"text": ...}, ...]}
        raise DataError(
            f"{where}: field '{field_name}' holds a {type(value).__name__}, not text; nested "
            "records are not read: write them out as JSON lines, one object per record (e.g. "
            f"jq -c '.{field_name}[]' IN.json > OUT.jsonl)"
        )
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field '{field_name}' holds a {type(value).__name__}, not text; "
            "set --text-field (data.text_field) to a string field"
        )
    return value


def first_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message`` of ``exc``, at most ``limit`` characters."""
    text = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text[:limit]
