#!/usr/bin/env bash
# Freeze the committed tree into .snap/ (git-ignored) for GPU calls, so edits in the working tree
# during a long study or a test run never reach the GPU host half-done (the whole tree: tests and
# evals/headline.py run from it too; .snap/.commit names the commit, which bench and headline
# record). Run from the repository root; then, in a quality call (carry .whl, .snap and
# data/quality-corpus):
#
#   cd .snap && ln -sfn ../data data && ln -sfn ../.whl .whl && mkdir -p ../runs \
#     && ln -sfn ../runs runs && evals/quality_gpu.sh evals/studies/llama60m_50m.yaml 530 4
#   (several studies side by side: evals/quality_gpu.sh A.yaml:2,B.yaml:2 530)
#
# The GPU test suite from the same snapshot (carry .whl and .snap):
#   cd .snap && PYTHONPATH=/tmp/site:$PWD python3 evals/headline.py --part 3 --only gpu_tests
#
# runs/ lies outside .snap/ (which each call replaces), so stopped runs resume on a warm machine.
# A machine may be released between calls (it waits only ~30 s): after every call copy the
# returned results JSON over evals/results/<name> and .snap/evals/results/<name> before the next
# call, so a fresh machine starts from it rather than from the snapshot's older copy.
set -euo pipefail
grep -qx "/.snap/" .git/info/exclude 2>/dev/null || echo "/.snap/" >> .git/info/exclude
rm -rf .snap && mkdir .snap
git archive HEAD | tar -x -C .snap
git rev-parse --short HEAD > .snap/.commit
du -sh .snap
