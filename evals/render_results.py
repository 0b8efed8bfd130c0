"""Render the committed GPU results (``evals/results/*.json``) into ``docs/RESULTS.md`` + PNGs.

Every number in the page is read from a results file, whose path, date, commit and GPU are printed
beside its table; nothing is typed in by hand. Re-run after committing new results::

    python evals/render_results.py            # writes docs/RESULTS.md and docs/img/*.png

It also renders the README's results table (between ``<!-- headline:begin -->`` and
``<!-- headline:end -->``): the rows of the files ``evals/headline.py`` regenerates, each number
linked to the current file of its stem; rows of other sources in that table are kept as they are.

The page is put together here from the section builders of ``results_training`` (quick start,
precision, throughput, two GPUs), ``results_side_by_side`` (ours beside the official code),
``results_memory`` (Llama-8B / 13B memory, kernels) and ``readme_table`` (the README's table),
which read the files through ``results_files``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from readme_table import render_readme
from results_files import REPO, RESULTS, current, load, provenance
from results_memory import (
    ab_table,
    cnp_hybrid,
    kernel_targets_section,
    memory_estimate,
    memory_lowmem,
    memory_options_table,
    slab_gemms,
)
from results_side_by_side import SIDE_BY_SIDE_COMMIT, side_by_side, side_by_side_on
from results_training import (
    gpu_time_table,
    multi_gpu,
    precision,
    throughput_chart,
    tokens_table,
    vertical_slice,
)

from poetxq.tools.cli_tools import check_output_file

README = REPO / "README.md"


def gpu_test_record(machines: tuple[str, ...] = ("h200", "h100")) -> list[str]:
    """The section of the GPU test records (``gpu_tests_<machine>_<commit>.json``, written by
    ``evals/headline.py --part 3``): one row per card with its current record's counts, duration
    and failed tests."""
    rows, sources = [], []
    for machine in machines:
        name = current("gpu_tests", machine)
        d = load(name)
        if d is None:
            continue
        c = d["counts"]
        names = [f.removeprefix("FAILED ") for f in d.get("failures", [])]
        if not c:  # cut off before pytest's summary: what the test log recorded as they ran
            names = names or [r["test"] for r in d.get("failed_tests", [])]
            n_run = d.get("tests_run", 0)
            c = {"passed": f"{n_run - len(names)} of {n_run} run", "failed": len(names),
                 "skipped": "–"}  # fmt: skip
        seconds = d["duration_s"] if d.get("duration_s") is not None else d["wall_s"]
        cut = " (cut off by its timeout)" if d.get("timed_out") else ""
        rows.append(
            f"| {d['gpu']} | {d['commit']} | {c.get('passed', 0)} | {c.get('failed', 0)} | "
            f"{c.get('skipped', 0)} | {seconds:.0f}{cut} | {'; '.join(names) or 'none'} |"
        )
        sources.append(provenance(name, d))
    if not rows:
        return []
    return [
        "## The test suite on the GPU",
        "",
        "The whole suite, slow tests included, in one device call (`evals/headline.py --part 3 "
        "--only gpu_tests`: pytest with 6 workers).",
        "",
        "| GPU | commit | passed | failed | skipped | seconds | failed tests |",
        "|---|---|---:|---:|---:|---:|---|",
        *rows,
        "",
        *sources,
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "RESULTS.md"))
    ap.add_argument(
        "--side-by-side-out",
        default=str(RESULTS / f"official_side_by_side_h200_{SIDE_BY_SIDE_COMMIT}.md"),
        help="where the side-by-side tables (ours beside the official code) also go on their own",
    )
    ap.add_argument("--readme", default=str(README),
                    help="the README whose headline table to re-render ('': none)")  # fmt: skip
    args = ap.parse_args(argv)
    out, sbs_out = Path(args.out), Path(args.side_by_side_out)
    try:  # before any plot is drawn or folder made
        check_output_file(out, "--out", ValueError)
        check_output_file(sbs_out, "--side-by-side-out", ValueError)
    except ValueError as exc:
        ap.error(str(exc))
    sbs = side_by_side()
    if sbs:
        sbs_out.write_text("\n".join(["#" + sbs[0][2:], *sbs[1:]]).rstrip() + "\n")
        print(f"wrote {sbs_out}")
    img = out.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    sections = [
        vertical_slice(),
        [
            "## Model quality",
            "",
            "POET-XQ against Q-GaLore, Q-APOLLO and AdamW, each tuned on the same budget, and "
            "parity with the official POET code: [QUALITY.md](QUALITY.md) (rendered by "
            "`python evals/quality.py report`).",
            "",
            *precision(),
        ],
        [
            "## Training throughput at Llama-1B and 3B",
            "",
            "`poetxq bench` on random tokens through `evals/throughput.py`, 8,192 tokens per "
            "step, fp32 parameters under bf16 autocast unless a table says otherwise. The POET "
            "runs replay a CUDA graph (`train.cuda_graph: auto`), the baselines run eagerly with "
            "torch's fused AdamW; a CUDA-graph run's memory is its reserved peak. *fast* is "
            "`poet.variant=fast`; the recipes' default is `mem`.",
            "",
            *throughput_chart(img),
            *tokens_table(current("throughput_1b"), "### Llama-1B, every method"),
            *tokens_table(current("throughput_3b"), "### Llama-3B, every method"),
            *tokens_table(current("throughput_1b", "h100"), "### Llama-1B on an H100"),
            *tokens_table(current("throughput_3b", "h100"), "### Llama-3B on an H100"),
            *gpu_time_table(
                "throughput_1b_profiled_h200_daf8277.json",
                "### Where the GPU time of a Llama-1B step goes (seq 256, torch.profiler)",
            ),
            *tokens_table(
                "throughput_1b_nf4_h200_e853350.json", "### NF4 `W0` (`poetxq4`) at Llama-1B"
            ),
            *tokens_table(
                "throughput_bf16true_h200_51324b4.json",
                "### `train.precision: bf16-true` (bf16 parameters, no autocast)",
            ),
            *tokens_table(
                "throughput_1b_adamw_graph_h200_880ffdd.json",
                "### AdamW in a CUDA graph too (`train.cuda_graph: true`)",
            ),
        ],
        side_by_side() + side_by_side_on("h100", "an H100"),
        [
            "## Llama-8B / 13B on one GPU: memory",
            "",
            *memory_estimate(),
            *memory_lowmem(),
            *memory_options_table(
                [
                    "gpu_memory_graph_h200_90a76c3.json",
                    "gpu_memory_graph_ckpt_chunk_h200_90a76c3.json",
                ],
                "### A CUDA graph's reserved peak against the estimate",
            ),
            *ab_table(
                "fuse_elementwise_h200.json",
                "### Fused RMSNorm and rotary (`train.fuse_elementwise`), A/B",
                "fuse_elementwise",
                "fused",
            ),
        ],
        kernel_targets_section()
        + kernel_targets_section(current("kernel_targets", "h100"), "on an H100")
        + slab_gemms()
        + cnp_hybrid(),
        multi_gpu(),
        gpu_test_record(),
    ]
    lines = [
        "# Results",
        "",
        "Generated by `python evals/render_results.py` from the JSON files in `evals/results/`, "
        "which hold the current measurement of each thing (older ones are in git history). Each "
        "table names its file, machine, date and commit; ratios are measured side by side in one "
        "run. How to measure again: [BENCHMARKS.md](BENCHMARKS.md).",
        "",
    ]
    for sec in sections:
        lines += sec
    out.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    print(f"wrote {out}")
    if args.readme:
        readme = Path(args.readme)
        text = readme.read_text(encoding="utf-8")
        try:
            new = render_readme(text)
        except ValueError as exc:
            print(f"{readme}: headline table left as it is ({exc})", file=sys.stderr)
            return 0
        if new != text:
            readme.write_text(new, encoding="utf-8")
            print(f"wrote {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
