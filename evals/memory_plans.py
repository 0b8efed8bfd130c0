r"""Memory plans measured as a user meets them: ``poetxq bench`` with ``--memory`` / ``--gpu-mem``,
one process per case, beside the plan's predicted peak (issue 30).

Each case is one command line of ``poetxq bench`` (POET-XQ at batch 1 × 2,048 tokens, one
micro-batch, gradient clipping at the recipe's 1.0) run in a fresh process, so every case starts
with an empty allocator and the allocator setting its plan applies. Recorded per case: the plan
the run took, the predicted peak, the measured allocated and reserved peaks (and the reserved
peak while the model was built, which must stay under the step's, and the peaks of the one
merge ``poetxq bench`` runs after the steps), the step time, and
whether the reserved peak stayed under the memory planned for (``--gpu-mem``) or under the
issue's target.

Cases (``--cases``, default all):

* ``8b-auto``: Llama-8B with no memory flag: on an H200 ``auto`` takes ``fastest``;
* ``8b-16gb``: the same planned for a 16 GiB GPU (``--gpu-mem 16GB``);
* ``8b-lowest`` / ``13b-lowest``: the lowest plan (targets 10 / 15 GiB reserved);
* ``70b-nf4-lowest`` / ``70b-int8-lowest``: Llama-70B, NF4 and int8 ``W0`` (targets 46 / 78 GiB).

Usage (on the GPU host; the 70B cases build 68 B-weight models: minutes each):
    python evals/memory_plans.py --out $OUT/memory_plans_h200.json \
        --cases 8b-auto 8b-16gb 8b-lowest 13b-lowest
    python evals/memory_plans.py --out $OUT/memory_plans_70b_h200.json \
        --cases 70b-nf4-lowest 70b-int8-lowest
``--no-relayout`` runs every case with :func:`poetxq.model.relayout.relayout_wanted` answering
False (an override inside the bench process, for the A/B of what the relayout buys; the cases
record ``relayout: false``). Since ac7034e's A/B the lowest plan skips it anyway (no flat groups).

CPU smoke test of the script itself:
    python evals/memory_plans.py --device cpu --cases smoke --out /tmp/memory_plans_smoke.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import provenance, write_json_atomic

GiB = 2**30
_STEP = ["--batch-size", "1", "--seq-len", "2048", "--set", "train.grad_accum=1"]
#: a tiny lowest-plan step on the CPU, with accumulation (the script's own test)
_SMOKE = [
    "--seq-len",
    "32",
    "--batch-size",
    "2",
    "--set",
    "train.grad_accum=2",
    "--memory",
    "lowest",
]
_SMOKE += ["--set", "model.num_hidden_layers=1", "--set", "train.precision=fp32"]
#: case -> (bench arguments, target reserved GiB or None, GiB planned for or None)
CASES: dict[str, tuple[list[str], float | None, float | None]] = {
    "8b-auto": (["--recipe", "llama-8b:poetxq", *_STEP], None, None),
    "8b-16gb": (["--recipe", "llama-8b:poetxq", *_STEP, "--gpu-mem", "16GB"], 16.0, 16.0),
    "8b-lowest": (["--recipe", "llama-8b:poetxq", *_STEP, "--memory", "lowest"], 10.0, None),
    "13b-lowest": (["--recipe", "llama-13b:poetxq", *_STEP, "--memory", "lowest"], 15.0, None),
    "70b-nf4-lowest": (["--recipe", "llama-70b:poetxq4", *_STEP, "--memory", "lowest"], 46.0, None),
    "70b-int8-lowest": (["--recipe", "llama-70b:poetxq", *_STEP, "--memory", "lowest"], 78.0, None),
    "smoke": (_SMOKE, None, None),
}


#: ``python -c`` program: the ``poetxq`` command with the relayout turned off (``--no-relayout``)
_NO_RELAYOUT = (
    "import sys; import poetxq.model.relayout as r; r.relayout_wanted = lambda *a, **k: False; "
    "from poetxq.tools.cli import main; sys.exit(main())"
)


def run_case(name: str, steps: int, device: str | None, relayout: bool = True) -> dict:
    """One ``poetxq bench`` process for case ``name``; its JSON, plus the verdicts.
    ``relayout=False``: the bench process skips the post-build relayout (``--no-relayout``)."""
    args, target, planned = CASES[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        head = ["-m", "poetxq"] if relayout else ["-c", _NO_RELAYOUT]
        cmd = [sys.executable, *head, "bench", *args, "--steps", str(steps),
               "--warmup", "1", "--out", str(out)]  # fmt: skip
        if device:
            cmd += ["--device", device]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        print(f"== {name} ({wall:.0f} s, exit {proc.returncode})", flush=True)
        print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n", flush=True)
        if proc.returncode != 0 or not out.is_file():
            return {"case": name, "ok": False, "exit": proc.returncode, "wall_s": wall,
                    "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}  # fmt: skip
        rec = json.loads(out.read_text())
    reserved = rec.get("peak_reserved_bytes")
    plan_line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("memory plan:")), "")
    result = {
        "case": name, "ok": True, "wall_s": wall, "command": "poetxq bench " + " ".join(args),
        "relayout": relayout,
        "plan": rec["memory_plan"], "plan_line": plan_line,
        "predicted_peak_gib": rec["estimated_peak_bytes"] / GiB,
        "peak_allocated_gib": (rec["peak_memory_bytes"] or 0) / GiB,
        "peak_reserved_gib": (reserved or 0) / GiB,
        "build_peak_reserved_gib": (rec.get("build_peak_reserved_bytes") or 0) / GiB,
        "merge_peak_allocated_gib": (rec.get("merge_peak_memory_bytes") or 0) / GiB,
        "merge_peak_reserved_gib": (rec.get("merge_peak_reserved_bytes") or 0) / GiB,
        "merge_s": rec.get("merge_s"),
        "step_time_s": rec["step_time_s"], "tokens_per_s": rec["tokens_per_s"],
        "target_reserved_gib": target, "planned_gib": planned, "bench": rec,
    }  # fmt: skip
    return {**result, **verdicts(rec, target)}


def verdicts(rec: dict, target: float | None) -> dict[str, bool]:
    """``meets_target``: the largest of the steps', the build's and the merge's reserved peaks
    is at most ``target`` GiB (what a GPU of that size must hold through a training run);
    ``build_within_step_peak``: building stayed under the steps' reserved peak (issue 30). Each
    left out where ``rec`` (a ``poetxq bench`` record) has no CUDA peak or no target is set."""
    out: dict[str, bool] = {}
    reserved, build = rec.get("peak_reserved_bytes"), rec.get("build_peak_reserved_bytes")
    merge = rec.get("merge_peak_reserved_bytes")
    if target is not None and reserved is not None:
        out["meets_target"] = max(reserved, build or 0, merge or 0) / GiB <= target
    if reserved is not None and build is not None:
        out["build_within_step_peak"] = build <= reserved
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=[c for c in CASES if c != "smoke"],
                   choices=list(CASES), help="which cases (default: all but smoke)")  # fmt: skip
    p.add_argument("--steps", type=int, default=3, help="timed steps per case (default 3)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--no-relayout", action="store_true",
                   help="skip the post-build relayout in every case (an A/B)")  # fmt: skip
    args = p.parse_args(argv)
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    doc = {**provenance(name, argv), "cases": []}
    for case in args.cases:
        doc["cases"].append(run_case(case, args.steps, args.device, not args.no_relayout))
        write_json_atomic(args.out, doc)  # each case as it finishes: a timeout keeps the rest
    bad = [c["case"] for c in doc["cases"] if not c["ok"]]
    print(f"wrote {args.out}; failed: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
