"""Run several recipe variants of the embedded default side by side and tabulate val perplexity.

Used to choose the embedded default's learning rates, batch and steps (on the GPU, where a run
takes seconds). Each variant is a list of ``poetxq quantize-and-train`` arguments.

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

from poetxq.cli import main as poetxq_main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", action="append", required=True, metavar="'NAME: ARGS'")
    args = ap.parse_args(argv)
    rows = {}
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
                          "wall_s": time.perf_counter() - start}  # fmt: skip
            Path(args.out).write_text(json.dumps(rows, indent=2))
    for name, r in rows.items():
        ppl = r.get("final_val_ppl", float("nan"))
        print(f"{name:12s} {ppl:8.2f}  ratio {ppl / r.get('unigram_val_ppl', 1):.3f}  {r['args']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
