"""The quality study: POET-XQ against tuned baselines under one protocol (issue 32).

A study file (YAML, ``evals/studies/*.yaml``) names the model, the token corpus
(:mod:`poetxq.data.corpus`), the token budget per run, the settings every method shares, and per
method its recipe, its own knobs and its learning-rate grid. The runner

1. **tunes**: every grid point of every method at the tuning seeds; a method whose best point
   (lowest ``tune`` perplexity) sits on a grid edge gets one more point past that edge (the
   step of the grid's last ratio), until its best is inside the grid or ``max_extend`` points
   were added per axis;
2. **finalizes**: each method's best setting at the final seeds, plus the control runs (POET-X
   with bf16 ``W0``, POET-XQ with frozen rotations) at POET-XQ's best setting;
3. scores every run on the ``test`` split, per source too, and records tokens/s without
   evaluation, the train / tune loss gap and the validation curve.

Runs run as worker processes, ``--jobs`` at a time (several share one GPU; with ``--gpus`` each
worker gets one GPU of the list in turn). Each finished run is merged into the study's results
JSON at once, so a study stopped anywhere (``--deadline``, a lost machine) continues with
``run`` again: finished runs are kept, an interrupted run resumes from its checkpoint when its
run folder is still there. ``report`` renders ``docs/QUALITY.md`` from the results JSON(s)
(:mod:`evals.quality_report`). The study file's model, each run's recipe, the planning and the
per-method summary live in :mod:`evals.quality_plan`; the workers' scheduling in
:mod:`evals.quality_runner`; this module is the command line.

Usage::

    python evals/prepare_offline_corpus.py --out data/quality-corpus
    python evals/quality.py plan evals/studies/llama60m_50m.yaml        # what runs next, and why
    python evals/quality.py run evals/studies/llama60m_50m.yaml --jobs 4 --deadline 540
    python evals/quality.py report evals/studies/llama60m_50m.yaml
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evals.quality_plan import (  # noqa: E402
    Study,
    check_runs,
    load_study,
    plan_runs,
    point_label,
    shown,
)
from evals.quality_runner import corpus_identity, execute, read_results  # noqa: E402

if TYPE_CHECKING:
    from poetxq.training.recipe import Recipe

__all__ = ["format_plan", "main"]


def format_plan(
    study: Study, pending: list[dict], state: dict[str, Any], recipes: dict[str, Recipe]
) -> list[str]:
    """``plan``'s lines: per method and control its state, then the pending runs in the order
    ``run`` starts them (:func:`plan_runs`' order, the methods in turn), each with why it is
    pending, its optimizer steps and training tokens.

    Args:
        pending, state: from :func:`plan_runs`.
        recipes: ``{run id: recipe}`` for ``pending`` (:func:`check_runs`).
    """
    lines: list[str] = []
    for name in [*study.methods, *study.controls]:
        if name in study.methods:
            st = state[name]
            size = math.prod(len(v) for v in study.methods[name].grid.values())
            ext = len(st["points"]) - size
            head = (
                f"tuned, best point {point_label(st['best'])}"
                if st["tuned"]
                else f"tuning, {len(st['points'])} points ({size} grid + {ext} edge extensions)"
            )
        else:
            like = study.controls[name].like
            head = (
                f"control at {like}'s best point"
                if state[like]["tuned"]
                else f"control, waits until {like} is tuned"
            )
        runs = sum(p["method"] == name for p in pending)
        lines.append(f"{name}: {head}; {runs} run(s) pending")
    width = max((len(p["id"]) for p in pending), default=0)
    places = len(f"[{len(pending)}]")
    total = 0
    for n, p in enumerate(pending, 1):
        tc = recipes[p["id"]].train
        steps = tc.max_steps
        tokens = steps * tc.batch_size * tc.grad_accum * tc.seq_len
        total += tokens
        lines.append(
            f"  {f'[{n}]':<{places}} {p['id']:<{width}}  {steps} steps, {_tokens(tokens)} "
            f"tokens  {p['why']}"
        )
    order = "; `run` starts them in this order (the methods in turn)" if pending else ""
    lines.append(f"{len(pending)} run(s) pending, {_tokens(total)} training tokens{order}")
    return lines


def _tokens(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n:,}"


_RESUME = (
    "Stopping and resuming: a `run` call may stop anywhere -- at --deadline, after --max-runs, "
    "or when the machine is lost. Every finished run is written to the results JSON as soon as "
    "it finishes and is kept. Give the same `run` command again to continue: it plans again from "
    "the results and starts only the runs still pending. A run stopped part-way by --deadline "
    "(SIGTERM: it saves a checkpoint first) resumes from that checkpoint when its run folder "
    "(<runs_dir>/<study name>/<run id>) is still there; a run whose folder is gone, or whose "
    "machine was lost before it could save one (unless `shared` sets train.save_every), starts "
    "over. A run that failed is tried again by the next call (its worker.log says why)."
)


def _paragraphs(*texts: str) -> str:
    return "\n\n".join(textwrap.fill(t, 88, break_on_hyphens=False) for t in texts)


def main(argv: list[str] | None = None) -> int:
    """``python evals/quality.py plan|run|report``; returns the exit status: 0, 2 for bad input
    (the study file, its corpus, its recipes, the results file or a flag: one ``error: ...``
    line on stderr, as ``poetxq``'s commands), 130 when ``run`` was stopped by Ctrl-C or
    SIGTERM."""
    ap = argparse.ArgumentParser(
        description=_paragraphs(
            "The quality study runner. `plan` lists the runs still to do in the order `run` "
            "starts them (why each is pending, its steps and tokens), `run` runs them, `report` "
            "renders docs/QUALITY.md from the results.",
            _RESUME,
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd, text in (
        ("plan", "list the runs still to do in the order `run` starts them: why each is "
                 "pending, steps and tokens"),
        ("run", "run the pending runs (stops cleanly at --deadline / --max-runs; run again to "
                "resume)"),
        ("report", "render docs/QUALITY.md from the results"),
    ):  # fmt: skip
        p = sub.add_parser(
            cmd, help=text, formatter_class=argparse.RawDescriptionHelpFormatter,
            description=_paragraphs(text[0].upper() + text[1:] + ".",
                                    *([_RESUME] if cmd == "run" else [])),
        )  # fmt: skip
        p.add_argument("study", nargs="+" if cmd == "report" else None, help="study YAML file")
        p.add_argument("--results", help="results JSON (default: the study's 'results')")
        if cmd == "run":
            p.add_argument(
                "--jobs", type=int, default=1,
                help="runs at a time (default 1). At Llama-60M each run holds 20-34 GiB of GPU "
                "memory, so 4 share one H200; a run that runs out of GPU memory goes back in "
                "the queue and fewer run at a time from then on",
            )  # fmt: skip
            p.add_argument("--gpus", help="comma-separated GPU ids to spread runs over")
            p.add_argument(
                "--methods", metavar="NAME[,NAME]",
                help="start only these methods' or controls' runs (e.g. the short ones when a "
                "long run cannot finish before the machine goes); the others stay pending",
            )  # fmt: skip
            p.add_argument(
                "--deadline", type=float, metavar="SECONDS",
                help="stop cleanly after this many seconds: a new run starts only while its "
                "method's typical time (from finished runs) fits, a run with a checkpoint "
                "resumes while a minute is left, and at the deadline running runs get SIGTERM "
                "and save a checkpoint; a later `run` resumes them",
            )  # fmt: skip
            p.add_argument(
                "--resume-later", action="store_true",
                help="with --deadline: start new runs even when their typical time does not "
                "fit (another `run` on the same machine will resume them); for runs longer "
                "than one call",
            )  # fmt: skip
            p.add_argument(
                "--max-runs", type=int, metavar="N",
                help="start at most N runs in this call and stop when they have finished; a "
                "later `run` goes on with the next ones",
            )  # fmt: skip
        if cmd == "report":
            p.add_argument(
                "--out",
                help="Markdown report; its plots go to img/ beside it (default, and only for "
                "the study files under evals/studies/: docs/QUALITY.md, with the parity "
                "section of evals/results/parity_official_*.json)",
            )  # fmt: skip
    args = ap.parse_args(argv)
    try:
        return _command(args)
    except SystemExit as exc:  # the one-line errors of the study, corpus, recipes and results
        if not isinstance(exc.code, str):  # a status, not a message: not ours to reword
            raise
        print(exc.code, file=sys.stderr)
        return 2


def _command(args: argparse.Namespace) -> int:
    """Run the parsed command; bad input raises ``SystemExit`` with its one error line."""
    if args.cmd == "report":
        from evals.quality_report import render

        committed = REPO / "evals" / "studies"
        ours = all(Path(f).resolve().parent == committed for f in args.study)
        if args.out is None and not ours:
            raise SystemExit(
                "error: report: --out is needed for a study outside evals/studies/ (the default, "
                "docs/QUALITY.md, is the committed studies' report)"
            )
        out = REPO / "docs" / "QUALITY.md" if args.out is None else Path(args.out).absolute()
        loaded = []
        for f in args.study:
            study = load_study(f)
            path = REPO / (args.results or study.results)
            loaded.append((study, read_results(path, study)))
        # the parity runs belong to the committed report only
        parity = (
            sorted((REPO / "evals" / "results").glob("parity_official_*.json"))
            if args.out is None
            else []
        )
        command = "python evals/quality.py report " + " ".join(
            str(shown(Path(f).absolute())) for f in args.study
        )
        render(loaded, out, parity, command=command)
        print(f"wrote {shown(out)}")
        return 0
    study = load_study(args.study)
    results_path = Path(args.results) if args.results else REPO / study.results
    if args.cmd == "plan":
        corpus_identity(study)  # a missing or incomplete corpus: one line now, not in a worker
        pending, state = plan_runs(study, read_results(results_path, study))
        recipes = check_runs(study, args.study, pending)  # a bad key: one line now
        print("\n".join(format_plan(study, pending, state, recipes)))
        return 0
    try:
        execute(
            study, Path(args.study).resolve(), results_path, jobs=args.jobs,
            gpus=args.gpus.split(",") if args.gpus else None, deadline=args.deadline,
            max_runs=args.max_runs, methods=args.methods.split(",") if args.methods else None,
            resume_later=args.resume_later,
        )  # fmt: skip
    except KeyboardInterrupt:  # execute stopped the workers and said so
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
