"""Run several recipe variants of the embedded default side by side and tabulate val perplexity.

Used to choose the embedded default's learning rates, batch and steps (on the GPU, where a run
takes seconds). Each variant is a list of ``poetxq quantize-and-train`` arguments.

The results JSON starts with the provenance header (date, GPU, torch, commit, command) and
holds each variant under ``runs``: its arguments, final and unigram validation perplexity,
tokens/s, the run's precision and wall time (or the exit code of a run that failed).

Usage:
    python evals/sweep.py --out sweep.json --variant "name: --lr 3e-3 --max-steps 300" ...
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import provenance, write_json_atomic

from poetxq.tools.cli import main as poetxq_main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", action="append", required=True, metavar="'NAME: ARGS'")
    args = ap.parse_args(argv)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    doc = {**provenance(device, argv), "runs": {}}
    rows = doc["runs"]
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.variant:
            name, _, rest = spec.partition(":")
            name = name.strip()
            start = time.perf_counter()
            code = poetxq_main(
                ["quantize-and-train", "--output-dir", tmp, "--run-name", name, "--no-progress",
                 *shlex.split(rest)]
            )  # fmt: skip
            if code:
                rows[name] = {"args": rest, "exit_code": code}
                continue
            s = json.loads((Path(tmp) / name / "summary.json").read_text())
            rows[name] = {"args": rest.strip(), "final_val_ppl": s["final_val_ppl"],
                          "unigram_val_ppl": s["unigram_val_ppl"],
                          "tokens_per_s": s.get("tokens_per_s"), "precision": s.get("precision"),
                          "steps": s.get("steps"),
                          "wall_s": time.perf_counter() - start}  # fmt: skip
            write_json_atomic(args.out, doc)
    for name, r in rows.items():
        ppl = r.get("final_val_ppl", float("nan"))
        print(f"{name:12s} {ppl:8.2f}  ratio {ppl / r.get('unigram_val_ppl', 1):.3f}  {r['args']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
