"""What the data layer takes and gives: :class:`DataConfig` (the recipe's ``data`` section),
:class:`TokenData` (packed windows and their tokenizer) and :class:`DataError`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from pydantic import Field, field_validator

from poetxq.schema import StrictSection, check_path_key

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
    """Where the text comes from, how it is split and tokenized, and where it is cached.

    The keys that may name a path, each relative to the working directory (not to the recipe
    file) and checked alike (:func:`poetxq.schema.check_path_key`): ``source`` (a file, folder
    or glob, unless ``embedded``, ``pydoc`` or ``hf:NAME``), ``tokenizer`` (a ``tokenizer.json``
    or tokenizer folder, unless ``bpe`` or ``gpt2``) and ``cache_dir``.
    """

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
    # file name endings read as plain text besides the built-in ones (poetxq.data.local
    # TEXT_SUFFIXES: .txt .md .markdown .rst .tex .org), e.g. [.log, .csv]; binary content is
    # refused by name as for .txt
    text_extensions: list[str] = Field(default_factory=list)

    @field_validator("text_extensions")
    @classmethod
    def _extensions(cls, value: list[str]) -> list[str]:
        """Each as ``.ext``, lower case (a leading dot is added where missing)."""
        out = []
        for ext in value:
            norm = "." + ext.strip().lower().lstrip(".")
            if norm == "." or any(c in norm for c in "/\\*?[]\x00") or len(norm) > 32:
                raise ValueError(
                    f"{ext!r} is not a file name ending; give endings such as .log or .csv"
                )
            out.append(norm)
        return out

    @field_validator("source", "tokenizer", "cache_dir")
    @classmethod
    def _path_keys(cls, value: str | None) -> str | None:
        check_path_key(value)
        return value


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
