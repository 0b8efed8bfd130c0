"""From documents to token streams: the BPE is trained on a sample of the training split, then
every document is encoded in batches and followed by the EOS token, up to the token caps
(:func:`tokenize_source`); :func:`pack` cuts a stream into non-overlapping windows of
``seq_len + 1`` tokens (the remainder is dropped)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from poetxq.data.config import DataConfig, DataError
from poetxq.data.documents import Source
from poetxq.data.split import dedup, tagged
from poetxq.data.tokenizer import Encoder, TokenizerSpec, train_bpe

_BPE_MAX_TRAIN_CHARS = 200_000_000  # most characters of training text a BPE is trained on
_ENCODE_BATCH_CHARS = 4_000_000  # characters per encode_batch call


class _Collector:
    """Encodes documents in batches and keeps per-split token streams (EOS after each doc)."""

    def __init__(
        self, encoder: Encoder, train_cap: int | None, val_cap: int | None, pbar: Any
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
class Streams:
    """The flat token streams of both splits (what the cache holds) and their encoder."""

    train: np.ndarray
    val: np.ndarray
    encoder: Encoder
    description: str


#: what the train / validation split divides, for the errors of a split left empty
_DOCUMENTS = (
    "a .txt file is one document, or documents of about 8,000 characters cut at its blank lines "
    "when longer; a .jsonl file has one per line"
)


def _one_document(description: str) -> DataError:
    """The DataError of a source of one document, which no ``data.val_fraction`` can split."""
    return DataError(
        f"{description} holds one document, and the train / validation split needs at least "
        f"two ({_DOCUMENTS}); add files, or write the text as a .jsonl file with one document "
        "per line"
    )


def _no_training_documents(description: str, n_val: int) -> None:
    """Raise the DataError of a source with no training document (``n_val`` went to val)."""
    if n_val == 1:
        raise _one_document(description)
    if n_val == 0:
        raise DataError(f"no training documents in {description}; check the source and "
                        "--text-field")  # fmt: skip
    raise DataError(
        f"no training documents in {description}: its {n_val} document(s) all went to the "
        f"validation split ({_DOCUMENTS}); lower data.val_fraction or add documents"
    )


def tokenize_source(
    cfg: DataConfig, source: Source, spec: TokenizerSpec, progress: bool
) -> Streams:
    """Read, split and encode ``source`` (training the BPE first when ``spec`` asks for it)."""
    from tqdm.auto import tqdm

    if source.predefined_split:
        assert source.train_documents is not None
        train_seen: set[bytes] = set()
        items: Iterator[tuple[bool, str]] = (
            (False, t) for t in dedup(source.train_documents(), train_seen)
        )
    else:
        assert source.documents is not None
        items = tagged(source.documents(), cfg)

    if spec.kind == "bpe":
        budget = _BPE_MAX_TRAIN_CHARS
        if cfg.max_train_tokens is not None:
            budget = min(budget, 8 * cfg.max_train_tokens)
        buffer, texts = _bpe_sample(items, budget)
        if not texts:  # the BPE trains on training documents: none, though maybe val ones
            _no_training_documents(source.description, sum(1 for v, _ in buffer if v))
        encoder = train_bpe(texts, cfg.vocab_size, progress)
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
            val_items = ((True, t) for t in dedup(source.val_documents(), set(), train_seen))
            col.consume(val_items, stop=lambda: col.full(True))
        else:
            col.consume(items, stop=col.done)
    finally:
        pbar.close()

    train, val = col.stream(False), col.stream(True)
    n_train, n_val = col.docs[False], col.docs[True]
    if train.size == 0:
        _no_training_documents(source.description, n_val)
    if val.size == 0 and n_train + n_val == 1:
        raise _one_document(source.description)
    if val.size == 0:
        raise DataError(
            f"validation split of {source.description} is empty ({n_train} document(s) in all, "
            f"split by document; {_DOCUMENTS}); raise data.val_fraction "
            "(--set data.val_fraction=0.1) or add documents"
        )
    description = (
        f"{source.description}, {n_train + n_val:,} documents "
        f"({n_train:,} train / {n_val:,} val); tokenizer: {encoder.description}"
    )
    return Streams(train, val, encoder, description)


def pack(stream: torch.Tensor, seq_len: int, split: str) -> torch.Tensor:
    """``stream`` cut into rows of ``seq_len + 1`` tokens (the remainder dropped)."""
    width = seq_len + 1
    rows = stream.numel() // width
    if rows == 0:
        raise DataError(
            f"{split} split has {stream.numel():,} tokens, fewer than seq_len + 1 = {width}; "
            "use a shorter seq_len or more data"
        )
    return stream[: rows * width].view(rows, width)
