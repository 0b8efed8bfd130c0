"""The quality study's runner: worker processes, their scheduling on one or several GPUs, and
the results JSON they are merged into (:func:`execute`). ``evals/quality.py run`` calls it;
the planning it follows lives in :mod:`evals.quality_plan`.

A worker (``python -m evals.quality_worker``) trains and scores one run in its own folder and
leaves ``result.json``; :func:`execute` records it at once, so a call stopped anywhere
(``--deadline``, Ctrl-C or SIGTERM, a lost machine) continues with the same command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from evals._common import git_commit, write_json_atomic
from evals.quality_plan import REPO, Study, check_runs, plan_runs, shown

__all__ = ["corpus_identity", "execute", "expected_seconds", "read_results"]


def read_results(path: Path, study: Study) -> dict[str, Any]:
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


def corpus_identity(study: Study) -> dict[str, Any]:
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
    now = corpus_identity(study)
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


def _record_orphans(study: Study, results: dict[str, Any], results_path: Path, echo: Any) -> int:
    """Record every pending run whose worker finished after its runner was stopped
    (:func:`_adoptable`), once, before any worker starts; returns how many."""
    runs_root = REPO / study.runs_dir / study.name
    found = 0
    for spec in plan_runs(study, json.loads(json.dumps(results)))[0]:
        if (rec := _adoptable(runs_root / spec["id"], spec)) is not None:
            results["runs"][spec["id"]] = rec
            found += 1
            echo(f"recorded {spec['id']}: its worker had finished after its runner stopped")
    if found:
        write_json_atomic(results_path, results)
    return found


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
    results = read_results(results_path, study)
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
        finished = _record_orphans(study, results, results_path, echo)
        finished += _loop(study, study_file, results, results_path, running, failed, durations,
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
