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
per-method summary live in :mod:`evals.quality_plan`; this module runs the workers.

Usage::

    python evals/prepare_offline_corpus.py --out data/quality-corpus
    python evals/quality.py plan evals/studies/llama60m_50m.yaml        # what runs next, and why
    python evals/quality.py run evals/studies/llama60m_50m.yaml --jobs 4 --deadline 540
    python evals/quality.py report evals/studies/llama60m_50m.yaml
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from evals._common import git_commit, write_json_atomic  # noqa: E402
from evals.quality_plan import (  # noqa: E402
    Study,
    check_runs,
    load_study,
    plan_runs,
    point_label,
    shown,
)

if TYPE_CHECKING:
    from poetxq.training.recipe import Recipe

__all__ = ["execute", "expected_seconds", "format_plan", "main"]


def format_plan(
    study: Study, pending: list[dict], state: dict[str, Any], recipes: dict[str, Recipe]
) -> list[str]:
    """``plan``'s lines: per method and control its state, then its pending runs, each with its
    place in the start order, why it is pending, its optimizer steps and training tokens.

    Args:
        pending, state: from :func:`plan_runs`.
        recipes: ``{run id: recipe}`` for ``pending`` (:func:`check_runs`).
    """
    order = {p["id"]: n for n, p in enumerate(pending, 1)}
    lines: list[str] = []
    total = 0
    for name in [*study.methods, *study.controls]:
        runs = [p for p in pending if p["method"] == name]
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
        lines.append(f"{name}: {head}; {len(runs)} run(s) pending")
        width = max((len(p["id"]) for p in runs), default=0)
        for p in runs:
            tc = recipes[p["id"]].train
            steps = tc.max_steps
            tokens = steps * tc.batch_size * tc.grad_accum * tc.seq_len
            total += tokens
            lines.append(
                f"  [{order[p['id']]}] {p['id']:<{width}}  {steps} steps, {_tokens(tokens)} "
                f"tokens  {p['why']}"
            )
    lines.append(
        f"{len(pending)} run(s) pending, {_tokens(total)} training tokens; `run` starts them in "
        "the [order] shown (methods in turn)"
    )
    return lines


def _tokens(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n:,}"


def _read_results(path: Path, study: Study) -> dict[str, Any]:
    if path.is_file():
        try:
            results = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(
                f"error: cannot read {path} ({exc}); move it away to start over"
            ) from None
        if results.get("study", {}).get("name") != study.name:
            raise SystemExit(f"error: {path} belongs to another study; give --results")
        return results
    return {"study": study.model_dump(mode="json"), "runs": {}, "calls": []}


def _corpus_identity(study: Study) -> dict[str, Any]:
    from poetxq.data.corpus import CorpusError, TokenCorpus

    try:
        m = TokenCorpus.open(REPO / study.corpus).manifest
    except CorpusError as exc:
        raise SystemExit(f"error: {exc}") from None
    return {
        "vocab_size": m["vocab_size"],
        "splits": {
            name: {k: s[k] for k in ("tokens", "documents", "sha256")}
            for name, s in m["splits"].items()
        },
        "sources": {
            src: {split: s["sources"].get(src, [0, 0, 0])[2] for split, s in m["splits"].items()}
            for src in m["splits"]["train"]["sources"]
        },
    }


def _check_corpus(study: Study, results: dict[str, Any]) -> None:
    """Record the corpus's splits (tokens, documents, SHA-256) in the results; refuse a corpus
    that differs from the one the earlier runs of this study used."""
    now = _corpus_identity(study)
    before = results.get("corpus")
    if before is not None and before["splits"] != now["splits"]:
        raise SystemExit(
            f"error: {study.corpus} is not the corpus this study's earlier runs used (its splits' "
            "SHA-256 differ); rebuild it with the same command or start a new results file"
        )
    results["corpus"] = now


class _Worker:
    def __init__(self, spec: dict, study_file: Path, run_dir: Path, gpu: str | None) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        self.spec, self.run_dir, self.gpu = spec, run_dir, gpu
        self.log = (run_dir / "worker.log").open("a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "evals.quality_worker", str(study_file), str(run_dir)],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.start = time.monotonic()


def _last_line(path: Path) -> str:
    """The last non-empty line of a worker's log (its error line, or a traceback's last)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "no log"
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "empty log")


def expected_seconds(study: Study, results: dict[str, Any], method: str) -> float | None:
    """A typical wall time (s) of one of ``method``'s runs in this study: the median over its
    finished runs of ``wall_s`` for a run that ran start to end in one call, else
    ``train_seconds`` + 30 s of scoring (a resumed run's ``wall_s`` is its last call's part only;
    its ``train_seconds`` spans every call); else the median over all methods; None when no run
    has finished yet. Runs of one call share the GPU, so these times include that."""

    def typical(recs: list[dict]) -> float | None:
        secs = sorted(
            r["train_seconds"] + 30.0 if r.get("resumed_from") or not r.get("wall_s")
            else r["wall_s"]
            for r in recs
            if r.get("train_seconds")
        )  # fmt: skip
        return secs[len(secs) // 2] if secs else None

    recs = [r for r in results.get("runs", {}).values() if isinstance(r, dict)]
    return typical([r for r in recs if r.get("method") == method]) or typical(recs)


def _startable(
    study: Study,
    results: dict[str, Any],
    pending: list[dict],
    runs_root: Path,
    left: float | None,
    resume_later: bool = False,
) -> dict | None:
    """The first pending run that may start with ``left`` seconds to the deadline: one with a
    checkpoint on disk while a minute is left (it resumes, and stops with a checkpoint again),
    a new one only when its method's typical time (:func:`expected_seconds`) fits, so a call on
    a machine that will not stay warm spends no time on runs it must throw away. With
    ``resume_later`` (the caller will call again on the same machine) a new run starts while a
    minute is left even when it cannot finish in this call: runs longer than one call need it."""
    for spec in pending:
        if left is None:
            return spec
        if left < 60.0:
            return None
        if resume_later or (runs_root / spec["id"] / "checkpoints").is_dir():
            return spec
        est = expected_seconds(study, results, spec["method"])
        if est is None or est <= left:
            return spec
    return None


def _out_of_memory(line: str) -> bool:
    """Whether a worker's last log line is CUDA's out-of-memory error (torch.OutOfMemoryError)."""
    return "OutOfMemoryError" in line or "CUDA out of memory" in line


def _progress(path: Path) -> str:
    """The worker's last trainer progress line (``step N ...``), or its last line."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "no log"
    steps = [ln.strip() for ln in lines if ln.strip().startswith("step ")]
    return steps[-1] if steps else _last_line(path)


def _adoptable(run_dir: Path, spec: dict) -> dict | None:
    """The ``result.json`` a worker left in ``run_dir`` for exactly this run (its ``spec.json``
    equal to ``spec``) that the results file never recorded: its runner was stopped while the
    worker went on and finished. None when there is none (or it is for another spec)."""
    try:
        if json.loads((run_dir / "spec.json").read_text()) != spec:
            return None
        rec = json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        return None
    return rec if rec.get("id") == spec["id"] else None


def _stop_workers(running: list[_Worker], echo: Any) -> None:
    """SIGTERM to every running worker (each saves its checkpoint), wait, one line each."""
    for w in running:
        w.proc.send_signal(signal.SIGTERM)
    for w in running:
        w.proc.wait()
        w.log.close()
        echo(f"stopped {w.spec['id']} after {time.monotonic() - w.start:.0f} s at: "
             f"{_progress(w.run_dir / 'worker.log')}")  # fmt: skip


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def execute(
    study: Study,
    study_file: Path,
    results_path: Path,
    *,
    jobs: int,
    gpus: list[str] | None,
    deadline: float | None,
    max_runs: int | None,
    echo: Any = print,
    methods: list[str] | None = None,
    resume_later: bool = False,
) -> dict[str, Any]:
    """Run pending runs until the study is done, ``max_runs`` finished or ``deadline`` seconds
    passed (running workers then get SIGTERM, which saves their checkpoint). ``methods``: start
    only these methods' and controls' runs (the others stay pending). ``resume_later``: start
    new runs even when they cannot finish before the deadline (see :func:`_startable`).
    Returns the results.

    Ctrl-C or SIGTERM stops the running workers the same way (each saves its checkpoint), records
    the study's state and raises ``KeyboardInterrupt``; the next call resumes them. A finished
    run's ``result.json`` that the results file lacks (its runner was killed while the worker
    went on) is recorded instead of trained again.

    Raises:
        SystemExit: ``methods`` names a method or control the study does not have.
        KeyboardInterrupt: stopped by Ctrl-C or SIGTERM (after the workers saved their state).
    """
    known = list(study.methods) + list(study.controls)
    unknown = [m for m in methods or [] if m not in known]
    if unknown:
        raise SystemExit(f"error: --methods: {', '.join(unknown)} not in the study; it has "
                         f"{', '.join(known)}")  # fmt: skip
    t0 = time.monotonic()
    results = _read_results(results_path, study)
    _check_corpus(study, results)
    check_runs(study, study_file, plan_runs(study, json.loads(json.dumps(results)))[0])
    results.setdefault("calls", []).append({
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": git_commit(),
        "command": "python " + " ".join(sys.argv),
        "device": _device_name(),
    })  # fmt: skip
    write_json_atomic(results_path, results)
    running: list[_Worker] = []
    durations: list[float] = []
    failed: set[str] = set()  # not retried in this call (their log says why)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if main_thread else None
    try:
        finished = _loop(study, study_file, results, results_path, running, failed, durations,
                         t0=t0, jobs=jobs, gpus=gpus, deadline=deadline, max_runs=max_runs,
                         echo=echo, methods=methods, resume_later=resume_later)  # fmt: skip
    except KeyboardInterrupt:
        _stop_workers(running, echo)
        results["state"] = plan_runs(study, results)[1]
        write_json_atomic(results_path, results)
        echo(f"interrupted: {len(running)} run(s) stopped with a checkpoint; run again to resume")
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    pending, state = plan_runs(study, results)
    results["state"] = state
    write_json_atomic(results_path, results)
    echo(f"{finished} run(s) finished in {time.monotonic() - t0:.0f} s; {len(pending)} pending")
    return results


def _loop(
    study: Study,
    study_file: Path,
    results: dict[str, Any],
    results_path: Path,
    running: list[_Worker],
    failed: set[str],
    durations: list[float],
    *,
    t0: float,
    jobs: int,
    gpus: list[str] | None,
    deadline: float | None,
    max_runs: int | None,
    echo: Any,
    methods: list[str] | None,
    resume_later: bool,
) -> int:
    """:func:`execute`'s scheduling loop; returns the number of runs finished."""
    runs_root = REPO / study.runs_dir / study.name
    started = finished = slot = 0
    while True:
        for w in list(running):
            if w.proc.poll() is None:
                continue
            running.remove(w)
            w.log.close()
            durations.append(time.monotonic() - w.start)
            out = w.run_dir / "result.json"
            if w.proc.returncode == 0 and out.is_file():
                rec = json.loads(out.read_text())
                rec["wall_s"] = round(durations[-1], 1)  # this call's time, scoring included
                results["runs"][w.spec["id"]] = rec
                write_json_atomic(results_path, results)
                finished += 1
                how = "diverged" if rec["diverged"] else f"tune ppl {rec['tune_ppl']:.3f}"
                echo(f"done {w.spec['id']}: {how}, {durations[-1]:.0f} s")
            else:
                log = w.run_dir / "worker.log"
                last = _last_line(log)
                if _out_of_memory(last) and running:
                    # the GPU is shared too thinly: run the others first, this one again later
                    jobs = len(running)
                    echo(f"out of GPU memory in {w.spec['id']} with {len(running) + 1} runs "
                         f"sharing the GPU: it goes back in the queue and at most {jobs} run "
                         "at a time from now (lower --jobs next time)")  # fmt: skip
                    continue
                failed.add(w.spec["id"])
                echo(f"FAILED {w.spec['id']} (exit {w.proc.returncode}): {last}; see {log}")
        elapsed = time.monotonic() - t0
        if deadline is not None and elapsed >= deadline and running:
            _stop_workers(running, echo)
            echo(f"deadline: {len(running)} run(s) stopped with a checkpoint; run again to resume")
            break
        pending, _ = plan_runs(study, results)
        skip = {w.spec["id"] for w in running} | failed
        pending = [p for p in pending if p["id"] not in skip]
        if methods:
            pending = [p for p in pending if p["method"] in methods]
        spec = None
        if len(running) < jobs and (max_runs is None or started < max_runs):
            left = None if deadline is None else deadline - elapsed
            spec = _startable(study, results, pending, runs_root, left, resume_later)
        if spec is not None and (rec := _adoptable(runs_root / spec["id"], spec)) is not None:
            results["runs"][spec["id"]] = rec
            write_json_atomic(results_path, results)
            finished += 1
            echo(f"recorded {spec['id']}: its worker had finished after its runner stopped")
            continue
        if spec is not None:
            gpu = gpus[slot % len(gpus)] if gpus else None
            slot += 1
            running.append(_Worker(spec, study_file, runs_root / spec["id"], gpu))
            started += 1
            log = shown(runs_root / spec["id"] / "worker.log")
            echo(f"start {spec['id']}" + (f" on GPU {gpu}" if gpu else "") + f" (log: {log})")
            continue
        if not running:
            if (
                pending
                and started == 0
                and deadline is not None
                and (max_runs is None or max_runs > 0)
            ):
                echo(_none_started(study, results, pending, deadline - elapsed))
            break
        time.sleep(0.5)
    return finished


def _none_started(study: Study, results: dict[str, Any], pending: list[dict], left: float) -> str:
    """Why a call with runs pending started none: the deadline's time left (see
    :func:`_startable`)."""
    if left < 60.0:
        return (f"no run started: {left:.0f} s were left before --deadline and a run starts only "
                "while a minute is left; give a longer --deadline")  # fmt: skip
    times = {
        m: expected_seconds(study, results, m) for m in dict.fromkeys(p["method"] for p in pending)
    }
    typical = ", ".join(f"{m} ~{t:.0f} s" for m, t in times.items() if t is not None)
    return (f"no run started: a new run starts only when its method's typical time fits the "
            f"{left:.0f} s left ({typical}); give a longer --deadline, or --resume-later to start "
            "runs that finish in a later call on the same machine")  # fmt: skip


def _device_name() -> str:
    """``N x <GPU name>`` when CUDA is there, else ``cpu (<machine>)``."""
    import platform

    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"

    return f"cpu ({platform.machine()})"


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
    """``python evals/quality.py plan|run|report``; returns the exit status (errors in the study,
    its corpus or its recipes end the program with one line and status 1)."""
    ap = argparse.ArgumentParser(
        description=_paragraphs(
            "The quality study runner. `plan` lists the runs still to do (per method: why each "
            "is pending, its steps and tokens), `run` runs them, `report` renders "
            "docs/QUALITY.md from the results.",
            _RESUME,
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd, text in (
        ("plan", "list the runs still to do: per method, why each is pending, steps and tokens"),
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
            loaded.append((study, _read_results(path, study)))
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
        _corpus_identity(study)  # a missing or incomplete corpus: one line now, not in a worker
        pending, state = plan_runs(study, _read_results(results_path, study))
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
