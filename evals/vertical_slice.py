"""The vertical slice's acceptance runs, side by side, on the embedded default recipe.

Runs, with identical data, seed and steps:
  * ``int8``    — ``poetxq quantize-and-train --bits 8`` (the default),
  * ``bits16``  — ``--bits 16`` (unquantized POET-X; fp32 on CPU),
  * ``control`` — ``--bits 8 --freeze-orthogonal`` (R = P = I frozen; only embeddings, norms and
    lm_head train),
  * ``nf4`` — ``--bits 4`` (NF4 W0) and ``fs`` — POET-FS with b = 128 (``poet.structure: full``),
    on request (``--runs``),
and writes one JSON with their validation perplexities, the unigram perplexity of the validation
split (add-one smoothing, counts from the training split), wall time and the checks of the issue:
int8 < 0.25 × unigram, int8 ≥ 10 % better than control, |bits16 − int8| ≤ 5 % of int8.

Usage:
    python evals/vertical_slice.py --out evals/results/vertical_slice_cpu.json [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import git_commit

from poetxq.tools.cli import main as poetxq_main

RUNS = {
    "int8": ["--bits", "8"],
    "bits16": ["--bits", "16"],
    "control": ["--bits", "8", "--freeze-orthogonal"],
    "nf4": ["--bits", "4", "--quant-type", "nf4"],
    # POET-FS at the paper's b = n/2 (d = 256): one 128 x 128 rotation per side, a new subset at
    # each merge (poet.structure: full)
    "fs": ["--bits", "8", "--set", "poet.structure=full", "--block-size", "128"],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--runs", nargs="+", default=["int8", "bits16", "control"], choices=list(RUNS))
    args = ap.parse_args(argv)
    extra = [x for kv in args.overrides for x in ("--set", kv)]
    results: dict[str, dict] = {}
    commit = git_commit()  # read before the runs: HEAD may move while they train
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs:
            start = time.perf_counter()
            code = poetxq_main(
                ["quantize-and-train", *RUNS[name], "--output-dir", tmp, "--run-name", name,
                 "--no-progress", *extra]
            )  # fmt: skip
            if code != 0:  # record and go on with the other runs
                print(f"run {name} failed with exit code {code}", file=sys.stderr)
                failed.append(name)
                continue
            summary = json.loads((Path(tmp) / name / "summary.json").read_text())
            summary["wall_seconds"] = time.perf_counter() - start
            summary.pop("run_dir")
            results[name] = summary
    report: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python evals/vertical_slice.py " + " ".join(argv or sys.argv[1:]),
        "commit": commit,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
        + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"),
        "runs": results,
        "failed_runs": failed,
    }
    if {"int8", "bits16", "control"} <= results.keys():
        i8, b16, ctl = (results[k]["final_val_ppl"] for k in ("int8", "bits16", "control"))
        uni = results["int8"]["unigram_val_ppl"]
        report["checks"] = {
            "int8_over_unigram": i8 / uni,
            "a_int8_below_quarter_unigram": i8 < 0.25 * uni,
            "control_over_int8": ctl / i8,
            "b_int8_beats_control_by_10pct": i8 <= 0.9 * ctl,
            "bits16_vs_int8_rel": abs(b16 - i8) / i8,
            "c_bits16_within_5pct": abs(b16 - i8) <= 0.05 * i8,
        }
    if {"int8", "nf4"} <= results.keys():
        i8, nf4 = results["int8"]["final_val_ppl"], results["nf4"]["final_val_ppl"]
        report.setdefault("checks", {})["nf4_vs_int8_rel"] = (nf4 - i8) / i8
        report["checks"]["nf4_within_10pct_of_int8"] = abs(nf4 - i8) <= 0.10 * i8
    if {"int8", "fs"} <= results.keys():
        i8, fs = results["int8"]["final_val_ppl"], results["fs"]["final_val_ppl"]
        report.setdefault("checks", {})["fs_vs_int8_rel"] = (fs - i8) / i8
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report.get("checks", {}), indent=2))
    for name, r in results.items():
        print(f"{name:8s} val ppl {r['final_val_ppl']:8.2f}  ({r['wall_seconds']:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
