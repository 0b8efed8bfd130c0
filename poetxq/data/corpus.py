"""A pre-tokenized corpus on disk: compressed token ids, fixed splits, per-source ranges.

Format ``poetxq-token-corpus/1``, a folder holding

* ``corpus.json`` -- the manifest (read with ``json``, never unpickled)::

      {"format": "poetxq-token-corpus/1", "tokenizer": "tokenizer.json",
       "vocab_size": 32000, "eos_id": 0, "dtype": "uint16",
       "splits": {"train": {"file": "train.u16.xz", "sha256": "...", "tokens": N,
                            "documents": D, "sources": {"dictionaries": [start, end, docs], ...}},
                  "tune": {...}, "test": {...}},
       "sources": {"dictionaries": {"packages": [...]}, ...}, ...}

* ``tokenizer.json`` -- a Hugging Face ``tokenizers`` file;
* one ``<split>.u16.xz`` per split: the split's token ids as little-endian ``uint16``, every
  document followed by ``eos_id``, compressed with LZMA (xz). Within a split the documents are
  grouped by source, so each source is one contiguous token range ``[start, end)``.

The splits are made by document (never within one), so a model trained on ``train`` has never seen
a ``tune`` or ``test`` document; ``tune`` is for choosing hyperparameters, ``test`` for the final
numbers. :func:`token_data` packs a corpus into the :class:`poetxq.data.TokenData` the trainer
takes.
"""

from __future__ import annotations

import json
import lzma
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from poetxq.paths import file_sha256

__all__ = ["FORMAT", "CorpusError", "TokenCorpus", "token_data", "write_token_corpus"]

FORMAT = "poetxq-token-corpus/1"
MANIFEST = "corpus.json"


class CorpusError(ValueError):
    """A token corpus folder that is missing, damaged or of another format (one-line message)."""


def write_token_corpus(
    folder: Path,
    tokenizer: Any,
    eos_id: int,
    splits: dict[str, dict[str, list[list[int]]]],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write a ``poetxq-token-corpus/1`` folder and return its manifest.

    Args:
        folder: output folder (created; existing corpus files in it are replaced).
        tokenizer: a ``tokenizers.Tokenizer`` (saved as ``tokenizer.json``).
        eos_id: the end-of-document token id appended after every document.
        splits: ``{split: {source: [document token ids, ...]}}``; sources keep their order.
        extra: more manifest fields (source descriptions, split seed and fractions...).

    Raises:
        CorpusError: a token id does not fit ``uint16`` (vocabulary over 65,536).
    """
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    if vocab_size > 1 << 16:
        raise CorpusError(f"vocabulary of {vocab_size:,} does not fit uint16; use at most 65,536")
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "tokenizer": "tokenizer.json",
        "vocab_size": vocab_size,
        "eos_id": int(eos_id),
        "dtype": "uint16",
        **(extra or {}),
        "splits": {},
    }
    for split, by_source in splits.items():
        pieces: list[np.ndarray] = []
        ranges: dict[str, list[int]] = {}
        start = n_docs = 0
        for source, docs in by_source.items():
            for ids in docs:
                pieces.append(np.asarray([*ids, eos_id], dtype=np.uint16))
            length = sum(len(ids) + 1 for ids in docs)
            ranges[source] = [start, start + length, len(docs)]
            start += length
            n_docs += len(docs)
        stream = np.concatenate(pieces) if pieces else np.zeros(0, np.uint16)
        name = f"{split}.u16.xz"
        tmp = folder / (name + ".tmp")
        tmp.write_bytes(lzma.compress(stream.astype("<u2").tobytes(), preset=9))
        tmp.replace(folder / name)
        manifest["splits"][split] = {
            "file": name,
            "sha256": file_sha256(folder / name),
            "tokens": int(stream.size),
            "documents": n_docs,
            "sources": ranges,
        }
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(folder / MANIFEST)
    return manifest


@dataclass
class TokenCorpus:
    """An opened ``poetxq-token-corpus/1`` folder (see the module docstring)."""

    folder: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, folder: str | Path) -> TokenCorpus:
        """Read ``folder/corpus.json`` and check that the files it names are there (their
        contents are checked when read: :meth:`tokens`, :meth:`tokenizer`).

        Raises:
            CorpusError: no manifest, unreadable JSON, another format, or a missing tokenizer or
                split file (one line naming the file and how to get it back).
        """
        folder = Path(folder)
        path = folder / MANIFEST
        if not path.is_file():
            build = "python evals/prepare_offline_corpus.py --out " + str(folder)
            text = ("*.txt", "*.md", "*/*.txt", "*/*.md")  # a look two levels deep, no more
            if folder.is_dir() and any(next(folder.glob(g), None) for g in text):
                # a folder of text: build the corpus from it, beside it, not into it
                build = (f"python evals/prepare_offline_corpus.py --text {folder} --out "
                         f"{folder}-corpus, and name {folder}-corpus instead")  # fmt: skip
            raise CorpusError(
                f"{folder} is not a token corpus (no {MANIFEST}); build one with {build}"
            )
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorpusError(f"{path} is unreadable ({exc}); rebuild the corpus") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CorpusError(f"{path} is not of format {FORMAT}; rebuild the corpus")
        splits = manifest.get("splits")
        if not isinstance(splits, dict) or not all(
            isinstance(s, dict) and isinstance(s.get("file"), str) for s in splits.values()
        ):
            raise CorpusError(f"{path} lists no valid splits; rebuild the corpus")
        files = {str(manifest.get("tokenizer", "tokenizer.json")): "tokenizer"}
        files.update({s["file"]: f"{name} split" for name, s in splits.items()})
        for name, what in files.items():
            if not (folder / name).is_file():
                raise CorpusError(_missing(folder, name, what))
        return cls(folder, manifest)

    @property
    def splits(self) -> list[str]:
        """Split names in manifest order (e.g. ``["train", "tune", "test"]``)."""
        return list(self.manifest["splits"])

    def _split(self, split: str) -> dict[str, Any]:
        try:
            return self.manifest["splits"][split]
        except KeyError:
            raise CorpusError(
                f"split {split!r} is not in {self.folder} (it has {', '.join(self.splits)})"
            ) from None

    def tokens(self, split: str) -> np.ndarray:
        """The split's token stream, ``uint16 [tokens]``, after checking its SHA-256.

        Raises:
            CorpusError: unknown split, missing file, or a checksum / length mismatch.
        """
        info = self._split(split)
        path = self.folder / info["file"]
        if not path.is_file():
            raise CorpusError(_missing(self.folder, info["file"], f"{split} split"))
        if file_sha256(path) != info["sha256"]:
            raise CorpusError(f"{path} does not match its SHA-256 in {MANIFEST}; copy it again")
        data = lzma.decompress(path.read_bytes())
        stream = np.frombuffer(data, dtype="<u2")
        if stream.size != info["tokens"]:
            raise CorpusError(
                f"{path} holds {stream.size} tokens, {MANIFEST} says {info['tokens']}"
            )
        return stream

    def source_ranges(self, split: str) -> dict[str, tuple[int, int]]:
        """``{source: (start, end)}`` token ranges of each source within ``split``."""
        return {s: (r[0], r[1]) for s, r in self._split(split)["sources"].items()}

    def tokenizer(self) -> Any:
        """The corpus's ``tokenizers.Tokenizer``.

        Raises:
            CorpusError: the tokenizer file is missing or unreadable.
        """
        from tokenizers import Tokenizer

        name = str(self.manifest.get("tokenizer", "tokenizer.json"))
        path = self.folder / name
        if not path.is_file():
            raise CorpusError(_missing(self.folder, name, "tokenizer"))
        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for a bad file
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise CorpusError(
                f"{path} is not a readable tokenizer ({first}); copy it again from the folder "
                f"the corpus was built in, or rebuild the corpus"
            ) from None


def _missing(folder: Path, name: str, what: str) -> str:
    """The one line for a corpus file that is not there: which file, and the two ways out."""
    return (
        f"token corpus {folder} lacks {name} (its {what}); rebuild the folder with python "
        f"evals/prepare_offline_corpus.py --out {folder}, or copy {name} from the corpus folder "
        "it was built in"
    )


def pack_windows(stream: np.ndarray, seq_len: int) -> torch.Tensor:
    """Cut a token stream into non-overlapping ``int64 [N, seq_len + 1]`` windows (rest dropped)."""
    n = stream.size // (seq_len + 1)
    flat = torch.from_numpy(stream[: n * (seq_len + 1)].astype(np.int64))
    return flat.view(n, seq_len + 1)


def token_data(
    corpus: TokenCorpus,
    seq_len: int,
    *,
    heldout: str = "tune",
    max_train_tokens: int | None = None,
    max_val_tokens: int | None = None,
) -> Any:
    """Pack ``corpus`` for :func:`poetxq.training.train.train`: ``train`` for training,
    ``heldout`` for validation, as a :class:`poetxq.data.config.TokenData` (windows of
    ``seq_len + 1`` tokens).

    ``max_val_tokens`` keeps an even spread over the held-out split (every k-th window), so every
    source stays represented.
    """
    from poetxq.data.config import TokenData

    train_stream = corpus.tokens("train")
    if max_train_tokens is not None:
        train_stream = train_stream[:max_train_tokens]
    val = pack_windows(corpus.tokens(heldout), seq_len)
    if max_val_tokens is not None and val.numel() > max_val_tokens:
        keep = max(1, max_val_tokens // (seq_len + 1))
        val = val[torch.linspace(0, val.shape[0] - 1, keep).round().long()]
    m = corpus.manifest
    return TokenData(
        train=pack_windows(train_stream, seq_len),
        val=val,
        tokenizer=corpus.tokenizer(),
        vocab_size=int(m["vocab_size"]),
        train_tokens=int(train_stream.size),
        val_tokens=int(val.numel()),
        source_description=f"token corpus {corpus.folder.name} ({heldout} split for validation)",
        eos_id=int(m["eos_id"]),
    )
