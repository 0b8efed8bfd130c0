"""The data layer's entry points: :func:`prepare_data` (source → split → tokens, cached → packed
windows) and :func:`unigram_perplexity` (the baseline a run's perplexity is read against)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from poetxq.data.cache import cache_key, cache_root, load_cache, save_cache
from poetxq.data.config import DataConfig, DataError, TokenData
from poetxq.data.corpus import MANIFEST, CorpusError, TokenCorpus, token_data
from poetxq.data.sources import resolve_source
from poetxq.data.streams import pack, tokenize_source
from poetxq.data.tokenizer import resolve_tokenizer


def is_token_corpus(source: str) -> bool:
    """Whether ``source`` is a pre-tokenized corpus folder (``corpus.json`` inside)."""
    return (Path(source.strip()).expanduser() / MANIFEST).is_file()


def _check_corpus_tokenizer(cfg: DataConfig) -> None:
    """A pre-tokenized corpus brings its tokenizer: ``data.tokenizer`` must be left at bpe."""
    if cfg.tokenizer != "bpe":
        raise DataError(
            f"{Path(cfg.source.strip()).expanduser()} is a pre-tokenized corpus with its own "
            f"tokenizer; drop --tokenizer {cfg.tokenizer} (data.tokenizer)"
        )


def _token_corpus_data(cfg: DataConfig, seq_len: int) -> TokenData | None:
    """A pre-tokenized corpus folder (:mod:`poetxq.data.corpus`, ``corpus.json`` inside): its
    ``train`` split trains, its ``tune`` split validates; its own tokenizer is used."""
    if not is_token_corpus(cfg.source):
        return None
    path = Path(cfg.source.strip()).expanduser()
    _check_corpus_tokenizer(cfg)
    try:
        return token_data(
            TokenCorpus.open(path), seq_len, heldout="tune",
            max_train_tokens=cfg.max_train_tokens, max_val_tokens=cfg.max_val_tokens,
        )  # fmt: skip
    except CorpusError as exc:
        raise DataError(str(exc)) from None


def check_data(cfg: DataConfig, seq_len: int) -> None:
    """The checks of :func:`prepare_data` that read no text: ``seq_len``, the source (a local
    path that exists, files of a supported type, not all of them empty; an ``hf:`` name), the
    tokenizer named, and whether a window of ``seq_len + 1`` tokens can fit each split (a token
    corpus's split sizes from its manifest; else the ``data.max_train_tokens`` /
    ``data.max_val_tokens`` caps). Cheap (file names and sizes, a manifest), so a run can refuse
    bad input in one line before it prints anything else.

    Raises:
        DataError: one line naming the problem and what to pass instead.
    """
    if seq_len < 1:
        raise DataError(f"seq_len must be at least 1, got {seq_len}")
    width = seq_len + 1
    if is_token_corpus(cfg.source):
        _check_corpus_tokenizer(cfg)
        path = Path(cfg.source.strip()).expanduser()
        try:
            splits = TokenCorpus.open(path).manifest["splits"]
        except CorpusError as exc:
            raise DataError(str(exc)) from None
        train = splits["train"]["tokens"]
        if cfg.max_train_tokens is not None:
            train = min(train, cfg.max_train_tokens)
        for split, n in (("training", train), ("validation (tune)", splits["tune"]["tokens"])):
            if n < width:
                raise DataError(
                    f"{split} split of {path} has {n:,} tokens, fewer than seq_len + 1 = "
                    f"{width:,}; use a shorter seq_len or more data"
                )
        return
    resolve_source(cfg)
    resolve_tokenizer(cfg)
    for split, key in (("training", "max_train_tokens"), ("validation", "max_val_tokens")):
        cap = getattr(cfg, key)
        if cap is not None and cap < width:  # the split keeps at most cap tokens
            raise DataError(
                f"{split} split keeps at most {cap:,} tokens (data.{key}), fewer than seq_len + 1 "
                f"= {width:,}; use a shorter seq_len, or data that long and data.{key} of at "
                f"least {width:,}"
            )


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
    source = resolve_source(cfg)
    spec = resolve_tokenizer(cfg)
    key = cache_key(cfg, source, spec)
    entry = cache_root(cfg) / key
    streams = load_cache(entry, key, spec)
    if streams is None:
        streams = tokenize_source(cfg, source, spec, progress)
        save_cache(entry, key, streams, save_tokenizer=spec.kind == "bpe")
    train = torch.from_numpy(streams.train.astype(np.int64))
    val = torch.from_numpy(streams.val.astype(np.int64))
    return TokenData(
        train=pack(train, seq_len, "training"),
        val=pack(val, seq_len, "validation"),
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
