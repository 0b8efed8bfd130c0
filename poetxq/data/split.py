"""The train/validation split: documents are deduplicated (exact text after stripping) and
document ``i`` goes to validation when ``blake2b(f"{split_seed}:{i}")`` maps below
``val_fraction`` -- the same on every run and machine. Validation text is never part of the
training stream, and a trained BPE tokenizer sees training documents only. Sources with their
own splits (local train/validation files, ``hf_val_split``) are deduplicated within each split,
and validation documents that also occur in training are dropped."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

from poetxq.data.config import DataConfig, DataError
from poetxq.data.sources import resolve_source


def _val_score(seed: int, index: int) -> float:
    """A uniform number in [0, 1) from (seed, document index); same on every machine."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def _doc_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def dedup(
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


def tagged(docs: Iterable[str], cfg: DataConfig) -> Iterator[tuple[bool, str]]:
    """(is_val, text) for each unique document, assigned by the seeded hash of its index."""
    for index, text in enumerate(dedup(docs, set())):
        yield _val_score(cfg.split_seed, index) < cfg.val_fraction, text


def iter_documents(cfg: DataConfig, split: str) -> Iterator[str]:
    """Yield the documents of ``split`` ("train" or "val"/"validation") as prepare_data sees them.

    Documents are stripped and deduplicated; token caps are not applied. For predefined
    train/validation files or HF splits, duplicates are removed within each split only.
    """
    if split not in {"train", "val", "validation"}:
        raise DataError(f"unknown split '{split}'; use 'train' or 'val'")
    want_val = split != "train"
    source = resolve_source(cfg)
    if source.predefined_split:
        assert source.train_documents is not None and source.val_documents is not None
        docs = source.val_documents() if want_val else source.train_documents()
        yield from dedup(docs, set())
        return
    assert source.documents is not None
    for is_val, text in tagged(source.documents(), cfg):
        if is_val == want_val:
            yield text
