"""What the data layer takes and gives: :class:`DataConfig` (the recipe's ``data`` section),
:class:`TokenData` (packed windows and their tokenizer) and :class:`DataError`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from pydantic import Field

from poetxq.schema import StrictSection

if TYPE_CHECKING:
    import tokenizers
    import transformers

#: End-of-document token of the trained BPE and of GPT-2.
EOS_TOKEN = "<|endoftext|>"
#: The smallest ``data.vocab_size`` (a byte-level BPE starts from 256 byte tokens).
MIN_VOCAB_SIZE = 256


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
    vocab_size: int = Field(4096, ge=MIN_VOCAB_SIZE)  # for tokenizer="bpe"; C4-scale runs want more
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
