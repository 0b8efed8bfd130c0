"""The on-disk token cache: the flat token streams of both splits (before packing, so
``seq_len`` is not part of the key) as ``.npy`` files, with the trained tokenizer and a
``meta.json``, under ``cache_dir`` / ``$POETXQ_CACHE`` / ``~/.cache/poetxq/data``. An entry is
written whole (a temporary folder renamed into place) or not at all."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

import numpy as np

from poetxq.data.config import DataConfig
from poetxq.data.documents import Source
from poetxq.data.streams import Streams
from poetxq.data.tokenizer import TokenizerSpec, fast_encoder

#: Bump when the way documents, splits or token streams are produced changes (invalidates caches).
CODE_VERSION = "poetxq-data-1"


def cache_root(cfg: DataConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("POETXQ_CACHE") or "~/.cache/poetxq/data"
    return Path(os.path.expanduser(root))


def cache_key(cfg: DataConfig, source: Source, spec: TokenizerSpec) -> str:
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


def save_cache(entry: Path, key: str, streams: Streams, save_tokenizer: bool) -> None:
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


def load_cache(entry: Path, key: str, spec: TokenizerSpec) -> Streams | None:
    """The streams of a complete entry, None when there is none (or it is unreadable: then it
    is removed, with one note)."""
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
            encoder = fast_encoder(tokenizer, meta["tokenizer_description"])
        else:
            encoder = spec.load()
    except (OSError, ValueError, KeyError) as e:
        # one line, not the loader's message (numpy's suggests unpickling, never done here);
        # the entry goes, so the tokens written next take its place
        _note(f"the data cache {entry} is unreadable ({type(e).__name__}); tokenizing again")
        shutil.rmtree(entry, ignore_errors=True)
        return None
    encoder.vocab_size, encoder.eos_id = int(meta["vocab_size"]), int(meta["eos_id"])
    return Streams(train, val, encoder, meta["description"])
