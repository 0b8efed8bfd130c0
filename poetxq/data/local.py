"""Local files as a source: a file, a directory (every supported file below it, sorted) or a
glob, read through the ``datasets`` library's ``text`` / ``json`` / ``parquet`` builders in
streaming mode (nothing is converted or cached on the way: the token streams are the one cache,
:mod:`poetxq.data.cache`).

* plain text: ``.txt`` and the documentation formats ``.md`` / ``.markdown`` / ``.rst`` /
  ``.tex`` / ``.org`` (:data:`TEXT_SUFFIXES`, read as they are, markup included), and any ending
  listed in ``data.text_extensions`` — one document per file; a file longer than about 8,000
  characters is cut at blank lines into documents of about that size. Line ends are read as
  ``\\n`` (``\\r\\n`` too). A file that is binary (a NUL byte, or more than 1 % of it not UTF-8)
  is refused by name; a stray undecodable byte becomes U+FFFD.
* ``.jsonl`` / ``.jsonl.gz`` / ``.json`` / ``.json.gz`` — JSON lines (such as a local C4 copy's
  ``c4-train.*.json.gz``) or a JSON list of records; ``.parquet`` — a table. Each record's text
  is its ``text_field``; a record whose field is null or empty (in JSON lines: or absent while
  other records of the file have it) is skipped, with one note per file giving the count.

If a directory (or glob) holds files whose names contain the word ``validation`` and files whose
names contain the word ``train`` (``c4-train.00000-of-00001.json.gz``; not ``constrained.jsonl``),
those files are the validation and training splits and ``val_fraction`` is not used; files
matching neither are not read, and the source's description names them.
"""

from __future__ import annotations

import contextlib
import glob as globlib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from poetxq.data.config import DataConfig, DataError
from poetxq.data.documents import Source, chunk_text, first_line, record_text

#: file name endings read as plain text (one document per file), besides ``data.text_extensions``
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".tex", ".org")
#: file name endings of record files (JSON lines, JSON lists, parquet tables)
RECORD_SUFFIXES = (".jsonl.gz", ".json.gz", ".jsonl", ".json", ".parquet")
SUPPORTED_SUFFIXES = (*RECORD_SUFFIXES, *TEXT_SUFFIXES)
#: share of bytes of a ``.txt`` file that may be undecodable as UTF-8 before it counts as binary
_MAX_BAD_UTF8 = 0.01
#: records handed over per batch when a file is read
_BATCH_ROWS = 1024


def is_text_file(path: Path, text_extensions: tuple[str, ...] | list[str] = ()) -> bool:
    """Whether ``path`` is read as plain text: its name ends in one of :data:`TEXT_SUFFIXES` or
    ``text_extensions`` (``data.text_extensions``, lower case with their dot)."""
    return path.name.lower().endswith((*TEXT_SUFFIXES, *text_extensions))


def _has_supported_suffix(path: Path, text_extensions: tuple[str, ...] | list[str] = ()) -> bool:
    return path.name.lower().endswith(RECORD_SUFFIXES) or is_text_file(path, text_extensions)


def _supported(text_extensions: tuple[str, ...] | list[str]) -> str:
    """The endings read, for the errors, with how to add one."""
    given = [e for e in text_extensions if e not in SUPPORTED_SUFFIXES]
    return (
        f"{', '.join((*SUPPORTED_SUFFIXES, *given))}; to read other plain-text files, list "
        "their ending in data.text_extensions (e.g. --set 'data.text_extensions=[.log]')"
    )


def local_files(
    source: str, text_extensions: tuple[str, ...] | list[str] = ()
) -> tuple[list[Path], str]:
    """Files named by a path (file / directory / glob) and a short description of the path;
    ``text_extensions`` (``data.text_extensions``) are read as text besides
    :data:`TEXT_SUFFIXES`."""
    expanded = os.path.expanduser(source)
    path = Path(expanded)
    if path.is_file():
        if not _has_supported_suffix(path, text_extensions):
            raise DataError(
                f"data file '{source}' has an unsupported type; use one of "
                f"{_supported(text_extensions)}"
            )
        files, what = [path.resolve()], f"file {source}"
    elif path.is_dir():
        files = sorted(
            p.resolve()
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )  # hidden files and folders (.cache, .git, editor swap files) are not data
        what = f"directory {source}"
    elif any(ch in expanded for ch in "*?["):
        matches = sorted(globlib.glob(expanded, recursive=True))
        if not matches:
            raise DataError(
                f"data path '{source}' does not exist; pass an existing file/dir/glob "
                "or --data embedded"
            )
        files = [Path(m).resolve() for m in matches if Path(m).is_file()]
        what = f"glob {source}"
    elif path.exists():  # a device, pipe or socket: not something to read as a corpus
        raise DataError(
            f"data path '{source}' is not a regular file or directory; pass a file/dir/glob "
            "or --data embedded"
        )
    else:
        raise DataError(
            f"data path '{source}' does not exist; pass an existing file/dir/glob "
            "or --data embedded"
        )
    files = [p for p in files if _has_supported_suffix(p, text_extensions)]
    if not files:
        raise DataError(f"no supported data files in {what}; supported types: "
                        f"{_supported(text_extensions)}")  # fmt: skip
    if all(p.stat().st_size == 0 for p in files):  # found before anything is read or printed
        which = (
            f"data file '{source}' is empty (0 bytes)"
            if path.is_file()
            else f"the {len(files)} data file(s) in {what} are all empty (0 bytes)"
        )
        raise DataError(f"{which}; pass a file with text in it, or --data embedded")
    return files, what


def _names_split(path: Path, split: str) -> bool:
    """Whether a file's name holds ``split`` as a word (``c4-train.00000-of-00001.json.gz``,
    ``train.jsonl``; not ``constrained.jsonl``)."""
    return re.search(rf"(?<![a-z]){split}(?![a-z])", path.name.lower()) is not None


def _listed(paths: list[Path], most: int = 3) -> str:
    names = ", ".join(p.name for p in paths[:most])
    return names + (f" and {len(paths) - most} more" if len(paths) > most else "")


def local_source(cfg: DataConfig) -> Source:
    files, what = local_files(cfg.source, cfg.text_extensions)
    field_name = cfg.text_field
    text_extensions = tuple(cfg.text_extensions)
    val_files = [p for p in files if _names_split(p, "validation")]
    train_files = [p for p in files if _names_split(p, "train") and p not in val_files]
    predefined = len(files) > 1 and bool(val_files) and bool(train_files)
    others = [p for p in files if p not in val_files and p not in train_files]
    unread = f"; not read, named neither train nor validation: {_listed(others)}" if others else ""

    def identity_of(paths: list[Path]) -> list[list[Any]]:
        out = []
        for p in paths:
            st = p.stat()
            out.append([str(p), st.st_size, st.st_mtime_ns])
        return out

    def reader(paths: list[Path]) -> Callable[[], Iterator[str]]:
        def documents() -> Iterator[str]:
            for p in paths:
                try:
                    yield from file_documents(p, field_name, text_extensions)
                except DataError:
                    raise
                except Exception as e:  # corrupt gzip/parquet/JSON, I/O errors
                    raise DataError(
                        f"{p} cannot be read ({first_line(e)}); fix or remove the file"
                    ) from None

        return documents

    # the files are read through `datasets` (line ends of .txt files as "\n"): a new key, so a
    # cache written by the earlier hand-written reader is not taken for this one's
    reader_id = "datasets-1"
    # how a file is read depends on the endings read as text (a .json listed there is text):
    # named in the identity where set, so the caches of sources without it keep their keys
    extra = {"text_extensions": sorted(text_extensions)} if text_extensions else {}
    if predefined:
        return Source(
            description=(
                f"local: {what} ({len(train_files)} train file(s), "
                f"{len(val_files)} validation file(s){unread})"
            ),
            identity={
                "kind": "local-split",
                "train": identity_of(train_files),
                "val": identity_of(val_files),
                "text_field": field_name,
                "reader": reader_id,
                **extra,
            },
            train_documents=reader(train_files),
            val_documents=reader(val_files),
        )
    return Source(
        description=f"local: {what} ({len(files)} file(s))",
        identity={
            "kind": "local",
            "files": identity_of(files),
            "text_field": field_name,
            "reader": reader_id,
            **extra,
        },
        documents=reader(files),
    )


def check_text_file(path: Path) -> None:
    """Refuse a plain-text file (``.txt``, ``.md``, ...: :func:`is_text_file`) that is binary
    (a NUL byte, or more than 1 % of it not UTF-8) by name, instead of training on it as
    replacement characters."""
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")
    if b"\x00" in raw or bad > _MAX_BAD_UTF8 * max(len(raw), 1):
        leave_out = (
            "remove it from the data or pass a glob that leaves it out (--data 'DIR/*.txt' "
            "matches only what you name)"
        )
        if b"\x00" in raw:
            raise DataError(f"{path} holds NUL bytes: it looks binary, not text; {leave_out}")
        # Latin-1 / cp1252 text reads like this too
        raise DataError(
            f"{path} is {bad / len(raw):.0%} not UTF-8: binary, or text in another encoding; "
            f"convert it (iconv -f latin1 -t utf-8 IN > OUT), or {leave_out}"
        )


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[Any]:
    """``datasets`` without its progress bars and without its own log line for a file it cannot
    parse (the one error poetxq raises names the file); both are as before afterwards."""
    import datasets
    from datasets import utils as ds_utils

    disabled = ds_utils.are_progress_bars_disabled()
    logger = logging.getLogger("datasets")
    level = logger.level
    ds_utils.disable_progress_bars()
    logger.setLevel(logging.CRITICAL)
    try:
        yield datasets
    finally:
        logger.setLevel(level)
        if not disabled:
            ds_utils.enable_progress_bars()


def _builder(path: Path, text: bool) -> tuple[str, dict[str, Any]]:
    name = path.name.lower()
    if text:  # one row per file: the whole text
        return "text", {"sample_by": "document", "encoding_errors": "replace"}
    if name.endswith(".parquet"):  # batches of a fixed size (an empty row group would ask for 0)
        return "parquet", {"batch_size": _BATCH_ROWS}
    return "json", {}  # JSON lines, or a JSON list of records; .gz read as it streams


def _records(path: Path, field_name: str, text: bool) -> Iterator[Any]:
    """The records of one file as ``datasets`` streams them: ``{field_name: value}`` dicts where
    the file's columns are known (and hold ``field_name``), whole records otherwise; ``text``:
    the file is plain text (one record)."""
    builder, kwargs = _builder(path, text)
    with _quiet_datasets() as datasets:
        try:  # data_files are patterns: a name with [ ] * ? is escaped
            ds = datasets.load_dataset(
                builder, data_files=[globlib.escape(str(path))], split="train", streaming=True,
                **kwargs,
            )  # fmt: skip
        except StopIteration:  # an empty file: no records, nothing to infer a schema from
            return
        columns = ds.column_names  # None where the fields are only known once read (JSON lists)
        if columns is None:
            rows: Iterator[Any] = iter(ds)
        elif field_name not in columns:
            raise DataError(
                f"{path} has no text field '{field_name}'; fields present: "
                f"{', '.join(columns) or '(none)'}; "
                "set --text-field (data.text_field) to the field with the text"
            )
        else:
            rows = iter(ds.select_columns([field_name]).iter(batch_size=_BATCH_ROWS))
    while True:
        with _quiet_datasets():  # the file is parsed as it is read
            try:
                item = next(rows)
            except StopIteration:
                return
        if columns is None:
            yield item
        else:
            for value in item[field_name]:
                yield {field_name: value}


def file_documents(
    path: Path, field_name: str, text_extensions: tuple[str, ...] | list[str] = ()
) -> Iterator[str]:
    """Documents of one local file (see the module docstring for the formats; a name ending in
    one of ``text_extensions`` is plain text too)."""
    is_text = is_text_file(path, text_extensions)
    if is_text:
        check_text_file(path)
        field_name = "text"  # the text builder's one column
    index = skipped = 0
    for index, rec in enumerate(_records(path, field_name, is_text), 1):
        text = record_text(rec, field_name, f"record {index} of {path}")
        if not text:  # a record without the field (in a file where others have it), null, ""
            if not is_text:  # (an empty .txt file is no record of anyone's)
                skipped += 1
            continue
        if is_text:
            yield from chunk_text(text)
        else:
            yield text
    if skipped:  # said once: the tokenized documents are cached
        print(
            f"note: {path}: {skipped:,} of {index:,} records have no text in field "
            f"'{field_name}' (missing, null or empty) and are skipped",
            file=sys.stderr,
        )
