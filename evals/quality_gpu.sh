#!/usr/bin/env bash
# One GPU call of a quality study (run from the repository root on the GPU host; $OUT is the
# folder whose files come back). Installs the carried wheels, starts from the study's committed
# results (finished runs are not run again), runs pending runs JOBS at a time until DEADLINE
# seconds, and leaves the updated results JSON and the log in $OUT. Runs stopped by the deadline
# keep a checkpoint under runs/quality/ and resume in the next call on the same machine.
#
#   evals/quality_gpu.sh evals/studies/llama60m_50m.yaml 520 4   (4 jobs fit one H200 at 60M)
set -uo pipefail
# the commit the results record: .commit (written beside a snapshot) when the tree has no .git
if [ -z "${POETXQ_COMMIT:-}" ] && [ -f .commit ]; then export POETXQ_COMMIT=$(cat .commit); fi
study=${1:?usage: evals/quality_gpu.sh STUDY.yaml [DEADLINE_S] [JOBS]}
deadline=${2:-520}
jobs=${3:-3}
out=${OUT:?OUT must name the folder to bring back}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
results=$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['results'])" "$study")
name=$(basename "$results")
# the newest results: the previous call's (same machine) or the committed file
if [ -f "runs/quality/$name" ]; then cp "runs/quality/$name" "$out/$name"
elif [ -f "$results" ]; then cp "$results" "$out/$name"; fi
PYTHONUNBUFFERED=1 python3 evals/quality.py run "$study" --jobs "$jobs" --deadline "$deadline" \
  --results "$out/$name" 2>&1 | tee "$out/quality_log.txt"
mkdir -p runs/quality && cp "$out/$name" "runs/quality/$name"
# where each unfinished run stopped (its worker log's tail), for the next call's planning
for log in runs/quality/*/*/worker.log; do
  [ -f "$log" ] && [ ! -f "$(dirname "$log")/result.json" ] && { echo "== $log"; tail -n 4 "$log"; }
done >>"$out/quality_log.txt" 2>/dev/null
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$out/quality_log.txt"
