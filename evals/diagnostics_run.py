"""Issue 31, item 3: the POET diagnostics (``train.diagnostics_every``) on one real run.

Trains the embedded default recipe (``poetxq quantize-and-train``) with ``--bits 8`` (POET-XQ)
and ``--bits 16`` (POET-X, the same run with an unquantized ``W0``), logging the diagnostics every
``--every`` steps, and writes the ``diag_*`` records of both runs with their provenance to one
JSON file and a plot (``docs/img/diagnostics_tiny.png`` by default). The bits-16 run separates
what the truncated Cayley-Neumann series costs from what int8 re-quantization at each merge adds.

    OMP_NUM_THREADS=1 python evals/diagnostics_run.py --out evals/results/diagnostics_tiny_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evals._common import provenance, write_json_atomic  # noqa: E402
from poetxq.model.diagnostics import DIAG_KEYS as KEYS  # noqa: E402
from poetxq.model.diagnostics import REQUANT_KEY  # noqa: E402


def run(bits: int, every: int, work: Path, extra: list[str]) -> dict[str, Any]:
    """Train the default recipe at ``bits`` with diagnostics every ``every`` steps; return its
    ``diag_*`` records, validation perplexities and summary."""
    from poetxq.tools.cli import main

    name = f"bits{bits}"
    argv = ["quantize-and-train", "--bits", str(bits), "--set", f"train.diagnostics_every={every}",
            *extra]  # fmt: skip
    if main([*argv, "--output-dir", str(work), "--run-name", name, "--no-progress"]) != 0:
        raise SystemExit(f"error: the bits-{bits} run failed (its output is above)")
    return read_run(work / name, "poetxq " + " ".join(argv))


def read_run(run_dir: Path, command: str) -> dict[str, Any]:
    """The ``diag_*`` records, validation perplexities and summary of a finished run directory
    (its ``metrics.jsonl``, ``summary.json`` and ``recipe.yaml``).

    Raises:
        SystemExit: a file is missing, or the run logged no ``diag_*`` record (one line).
    """
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        summary = json.loads((run_dir / "summary.json").read_text())
        resolved = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    except FileNotFoundError as exc:
        raise SystemExit(f"error: {run_dir} is not a finished run directory: {exc}") from None
    metrics = [json.loads(ln) for ln in lines]
    if not any(KEYS[0] in m for m in metrics):
        raise SystemExit(
            f"error: {run_dir}/metrics.jsonl has no diagnostics; train with "
            "--set train.diagnostics_every=N"
        )
    return {
        "command": command,
        "device": summary.get("device"),
        "diag": [{"step": m["step"], **{k: m[k] for k in KEYS}} for m in metrics if KEYS[0] in m],
        "val_ppl": [
            {"step": m["step"], "val_ppl": m["val_ppl"]} for m in metrics if "val_ppl" in m
        ],
        "requant_error": [
            {"step": m["step"], REQUANT_KEY: m[REQUANT_KEY]} for m in metrics if REQUANT_KEY in m
        ],
        # a resume: runs before 3fb6bc5 re-based sigma_drift_init and the cosines there
        "resumed_at": [m["step"] for m in metrics if m.get("event") == "resumed"],
        "merges": summary.get("merges"),
        "merge_interval": resolved["poet"]["merge_interval"],
        "final_val_ppl": summary.get("final_val_ppl"),
    }


def plot(doc: dict[str, Any], path: Path) -> None:
    """Four panels (spectrum drift, orthogonality error, energy, cosines), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        (("diag_sigma_drift_init", "diag_sigma_drift_w0"), "singular-value drift (relative)"),
        (("diag_orth_error",), "max ‖GᵀG − I‖₂ of the CNP blocks"),
        (("diag_energy",), "hyperspherical energy (512 neurons / layer)"),
        (("diag_cos_median", "diag_cos_min"), "neuron cosine to its initial direction"),
    )
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (keys, title) in zip(axes.flat, panels, strict=True):
        for i, (label, r) in enumerate(doc["runs"].items()):
            for key, style in zip(keys, ("-", "--"), strict=False):
                ax.plot([d["step"] for d in r["diag"]], [d[key] for d in r["diag"]], style,
                        color=f"C{i}", marker=".", ms=3,
                        label=f"{label}: {key.removeprefix('diag_')}")  # fmt: skip
        if keys == ("diag_orth_error",):  # each merge's W0 re-quantization error beside it
            for i, (label, r) in enumerate(doc["runs"].items()):
                pts = r.get("requant_error", [])
                ax.plot([d["step"] for d in pts], [d[REQUANT_KEY] for d in pts], "x",
                        color=f"C{i}", label=f"{label}: W0 re-quantization error")  # fmt: skip
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for x in doc.get("merge_steps", []):
        for ax in axes.flat:
            ax.axvline(x, color="grey", lw=0.6, ls=":")
    for x in sorted({s for r in doc["runs"].values() for s in r.get("resumed_at", [])}):
        for ax in axes.flat:
            ax.axvline(x, color="red", lw=0.8, ls="--")
        axes.flat[0].annotate("resumed", (x, 0), xytext=(3, 3), textcoords="offset points",
                              color="red", fontsize=7)  # fmt: skip
    fig.suptitle(doc.get("title") or "POET-XQ and POET-X against exact POET")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results JSON")
    ap.add_argument("--plot", default=str(REPO / "docs" / "img" / "diagnostics_tiny.png"))
    ap.add_argument("--every", type=int, default=10, help="train.diagnostics_every (steps)")
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 16])
    ap.add_argument(
        "--from", dest="run_dirs", nargs="+", metavar="LABEL=RUN_DIR",
        help="read finished runs instead of training (e.g. the quality study's diag controls, "
        "from the run_files.tgz of evals/quality_gpu.sh): 'int8=DIR fp=DIR'",
    )  # fmt: skip
    ap.add_argument("--title", default="Embedded default recipe: POET-XQ (int8) and POET-X "
                    "(bf16/fp32 W0) against exact POET", help="the plot's title")  # fmt: skip
    ap.add_argument("--note", help="free text kept in the JSON (with --from: where the runs "
                    "ran, at which commit)")  # fmt: skip
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="extra recipe override for both runs (e.g. train.max_steps=40)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    import torch

    if args.run_dirs:
        if any("=" not in x for x in args.run_dirs):
            ap.error("--from takes LABEL=RUN_DIR pairs, e.g. 'int8=runs/a fp=runs/b'")
        pairs = [x.split("=", 1) for x in args.run_dirs]
        runs = {label: read_run(Path(d), f"(read from {d})") for label, d in pairs}
        device = ", ".join(sorted({str(r["device"]) for r in runs.values()}))
        what = "the runs' own recipes (see each run's command)"
        first = next(iter(runs.values()))["diag"]
        every = first[1]["step"] - first[0]["step"] if len(first) > 1 else None
    else:
        extra = [a for kv in args.set for a in ("--set", kv)]
        with tempfile.TemporaryDirectory() as tmp:
            runs = {f"bits {b}": run(b, args.every, Path(tmp), extra) for b in args.bits}
        device, what, every = (
            f"cpu, {torch.get_num_threads()} threads",
            "the embedded default recipe",
            args.every,
        )
    interval = next(iter(runs.values()))["merge_interval"]
    steps = max(d["step"] for r in runs.values() for d in r["diag"])
    doc = {
        **provenance(device, argv),
        "what": "diag_* records of train.diagnostics_every (poetxq.model.diagnostics) on "
        f"{what}; measured before the merge on merge steps",
        "title": args.title,
        **({"note": args.note} if args.note else {}),
        "every": every,
        "merge_steps": list(range(interval, steps, interval)),
        "runs": runs,
    }
    write_json_atomic(args.out, doc)
    plot(doc, Path(args.plot))
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
