#!/usr/bin/env bash
# One GPU call of one or more quality studies (run from the repository root on the GPU host;
# $OUT is the folder whose files come back). Installs the carried wheels, starts each study from
# its newest results (finished runs are not run again), runs its pending runs JOBS at a time until
# DEADLINE seconds, and leaves each study's updated results JSON and log in $OUT. Several studies
# run side by side on the one GPU (their JOBS add up: at most 4 runs of Llama-60M on one H200).
# Runs stopped by the deadline keep a checkpoint under runs/quality/ and resume in the next call
# on the same machine; QUALITY_RESUME_LATER=1 starts new runs that cannot finish in this call
# (the next call on the warm machine resumes them: runs longer than one call need it; leave it
# off in a session's last call, whose new runs would be lost with the machine).
#
#   evals/quality_gpu.sh evals/studies/llama60m_50m.yaml 520 4      (4 jobs fit one H200 at 60M)
#   evals/quality_gpu.sh evals/studies/llama60m_50m.yaml:2,evals/studies/llama60m_150m.yaml:2 520
#   evals/quality_gpu.sh evals/studies/llama60m_150m.yaml:2:poetxq 520   (only these methods)
set -uo pipefail
# the commit the results record: .commit (written beside a snapshot) when the tree has no .git
if [ -z "${POETXQ_COMMIT:-}" ] && [ -f .commit ]; then export POETXQ_COMMIT=$(cat .commit); fi
studies=${1:?usage: evals/quality_gpu.sh STUDY.yaml[:JOBS[:METHOD+METHOD]][,...] [DEADLINE_S] [JOBS]}
deadline=${2:-520}
default_jobs=${3:-3}
out=${OUT:?OUT must name the folder to bring back}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
mkdir -p runs/quality
marker=$(mktemp) && touch "$marker"  # runs finished from here on are this call's

run_study() {  # STUDY JOBS [METHODS]: one study's call, its results and log into $OUT
  local study=$1 jobs=$2 methods=${3:-} results name log
  results=$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['results'])" "$study")
  name=$(basename "$results")
  log="$out/${name%.json}_log.txt"
  # the newest results: the previous call's (same machine) or the committed file
  if [ -f "runs/quality/$name" ]; then cp "runs/quality/$name" "$out/$name"
  elif [ -f "$results" ]; then cp "$results" "$out/$name"; fi
  PYTHONUNBUFFERED=1 python3 evals/quality.py run "$study" --jobs "$jobs" --deadline "$deadline" \
    --results "$out/$name" ${methods:+--methods "${methods//+/,}"} \
    ${QUALITY_RESUME_LATER:+--resume-later} >"$log" 2>&1
  cp "$out/$name" "runs/quality/$name"
}

pids=()
IFS=',' read -ra specs <<<"$studies"
for spec in "${specs[@]}"; do
  IFS=':' read -r study jobs methods <<<"$spec"
  run_study "$study" "${jobs:-$default_jobs}" "$methods" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
# the run files of this call's finished runs (metrics.jsonl with any train.diagnostics_every
# records, summary.json, recipe.yaml), for evals/diagnostics_run.py --from and the curves
(cd runs/quality && find . -name summary.json -newer "$marker" -printf '%h\n' | while read -r d; do
  for f in metrics.jsonl summary.json recipe.yaml; do [ -f "$d/$f" ] && echo "$d/$f"; done
done | tar -czf "$out/run_files.tgz" -T -) 2>/dev/null
# each study's lines (what started, finished, stopped), then where each unfinished run stopped
# (its worker log's tail), for the next call's planning
for log in "$out"/*_log.txt; do
  echo "== $(basename "$log")"; grep -vE "^WARNING: Target|^\s|Traceback|File " "$log" | tail -20
done
for log in runs/quality/*/*/worker.log; do
  [ -f "$log" ] && [ ! -f "$(dirname "$log")/result.json" ] && { echo "== $log"; tail -n 4 "$log"; }
done >>"$out/unfinished_log.txt" 2>/dev/null
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$out/unfinished_log.txt"
