"""Regenerate every GPU headline number of the README in three 10-minute H200 calls.

Each part runs the eval scripts that made today's headline files, with the same arguments, as
subprocesses, and writes canonically named files ``<stem>_h200_<commit7>.json`` (``_h100_`` when
the card is an H100: such files never replace an H200's) into
``--out-dir`` (default ``$OUT``), plus ``headline_part<N>_h200_<commit7>.json``: every command,
its exit status, wall seconds and output tail. A failing command is recorded and the part goes
on; each command gets a timeout, and a part stops before its budget (default 570 s), skipping
what no longer fits (recorded as skipped).

  part 1  tokens/s of every method at Llama-3B and 1B (evals/throughput.py)
  part 2  Llama-8B / 13B peak memory and step time, ours and the official step beside it
          (evals/gpu_memory.py; the official steps need --official)
  part 3  issue 3's kernel targets (evals/kernel_targets.py, official layers with --official),
          then the whole test suite on the GPU (pytest -m "slow or not slow"): the GPU test
          record gpu_tests_h200_<commit7>.json (summary line, counts, duration, commit)
  part x2 not one of the three: the 2-GPU row (evals/multi_gpu.py), on a 2-GPU machine

Durations, per command in the dry run, measured: part 1 451 s on an H100 at a7b3d14 (the 3B
command reached its then 300 s timeout); part 2 441 s on an H100 at ac7034e; part 3 about 530 s
(kernel_targets 134 s on an H100 at 9415d2f, the suite 363 s on an H200 at 8bd18da and 391 s
on an H100 at baf757c).

The device calls (carry .whl, built by ``bash evals/gpu_wheels.sh``, and, for the official code,
.official; the tree that travels has no .git, so name the commit):

  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \\
      && export PYTHONPATH=/tmp/site:$PWD && POETXQ_COMMIT=<commit7> PYTHONUNBUFFERED=1 \\
      python3 evals/headline.py --part 1 --official .official
  (the same with --part 2, then --part 3)

Then, here: ``python evals/headline.py --adopt DIR`` copies the returned files into
``evals/results/``, removes (git rm) the files they supersede (same stem, older), renders
kernel_targets' Markdown, and ``python evals/render_results.py`` renders docs/RESULTS.md and the
README's headline table from the current files.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "evals" / "results"
#: the default wall budget of one part, under a device call's 600 s
PART_BUDGET_S = 570
#: seconds kept back at the end of a part (writing the log, the call's own exit)
MARGIN_S = 15
#: a command is started only with at least this share of its estimate left in the part's budget
MIN_SHARE = 0.6


@dataclass(frozen=True)
class Step:
    """One command of a part: ``stem`` names its file ``<stem>_<machine>_<commit7>.json``."""

    stem: str
    part: str
    argv: tuple[str, ...]  # after ``python``; ``--out FILE`` is appended (not for pytest)
    est_s: int  # expected wall seconds (unmeasured unless the note says so)
    timeout_s: int
    env: dict[str, str] = field(default_factory=dict)
    official: str = ""  # "" no official code; "needs": skipped without --official; "optional"
    machine: str = "h200"
    note: str = ""

    def out_name(self, commit: str, gpu: str | None = None) -> str:
        """The file's name; ``gpu``: the card's name (torch.cuda.get_device_name), which sets
        the machine tag: ``h100`` for an H100, else this step's (``h200``, ``h200x2``)."""
        return f"{self.stem}_{machine_tag(self.machine, gpu)}_{commit}.json"


def machine_tag(machine: str, gpu: str | None) -> str:
    """``machine`` (a Step's, ``h200`` or ``h200x2``) with ``h200`` replaced by ``h100`` when
    ``gpu`` names an H100: a file says which card made it, and an H100's file never supersedes
    an H200's (:func:`adopt` and :func:`current` match the tag)."""
    return machine.replace("h200", "h100") if gpu and "H100" in gpu else machine


_MEM8 = ("--set", "optim.state_bits=8")
_CKPT_OPTIONS = ("--settings", "ckpt", "--cuda-graph", "--offload", *_MEM8,
                 "--set", "train.optimizer_in_backward=true", "--set", "optim.grad_clip=0",
                 "--set", "train.loss_chunk_tokens=256")  # fmt: skip
_TPUT = ("--seqs", "1024,256", "--methods", "qgalore,qapollo,adamw",
         "--graph-methods", "poetxq,poetxq+fast,poetx")  # fmt: skip
#: pytest's command for the GPU test record: the whole suite, as CI selects it (the ini's addopts,
#: ``-q -m 'not slow'``, replaced: one -q more would drop the summary line)
PYTEST = ("-m", "pytest", "-o", "addopts=", "-q", "-m", "slow or not slow", "--tb=short", "-rfE",
          "-p", "no:cacheprovider")  # fmt: skip

# fmt: off
STEPS: tuple[Step, ...] = (
    Step("throughput_3b", "1", ("evals/throughput.py", "--models", "llama-3b", *_TPUT), 290, 340,
         note="12 bench runs; the first call compiles the Triton kernels; over 300 s on an H100"),
    Step("throughput_1b", "1", ("evals/throughput.py", "--models", "llama-1b", *_TPUT), 160, 240,
         note="146 s after the 3B run on an H100 at a7b3d14"),
    Step("gpu_memory_8b_official", "2", ("evals/gpu_memory.py", "--models", "llama-8b", *_MEM8),
         130, 220, official="needs",
         note="ours eager, then the official step, both settings: 173 s on an H100 at ac7034e"),
    Step("gpu_memory_13b_official", "2", ("evals/gpu_memory.py", "--models", "llama-13b", *_MEM8),
         110, 200, official="needs", note="took 113 s after the 8B calls at d5a8a3e"),
    Step("gpu_memory_8b_graph", "2", ("evals/gpu_memory.py", "--models", "llama-8b", *_MEM8,
         "--cuda-graph", "--set", "train.loss_chunk_tokens=256"), 45, 120,
         note="about 27 s after the official call at d5a8a3e"),
    Step("optim8bit_13b_ours", "2", ("evals/gpu_memory.py", "--models", "llama-13b", *_MEM8,
         "--cuda-graph", "--settings", "no_ckpt"), 45, 120),
    Step("gpu_memory_8b_relayout_expandable", "2", ("evals/gpu_memory.py", "--models",
         "llama-8b", *_CKPT_OPTIONS), 50, 120,
         env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    Step("gpu_memory_13b_relayout_expandable", "2", ("evals/gpu_memory.py", "--models",
         "llama-13b", *_CKPT_OPTIONS), 60, 150,
         env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    Step("kernel_targets", "3", ("evals/kernel_targets.py",), 140, 300, official="optional",
         note="measured: 191 s at 7857f3d, 134 s on an H100 at 9415d2f"),
    Step("gpu_tests", "3", PYTEST, 390, 540, env={"OMP_NUM_THREADS": "2"},  # 6 workers, 16 cores
         note="the whole suite: 363 s on an H200 at 8bd18da, 391 s on an H100 at baf757c; its "
         "timeout is what is left"),
    Step("multi_gpu_step", "x2", ("evals/multi_gpu.py", "--parts", "equivalence,throughput",
         "--equiv-methods", "poetxq@step,poetxq", "--tput-methods",
         "poetxq@step,poetxq@ddp,adamw", "--budget-s", "540"), 400, 570, machine="h200x2",
         note="398.7 s at ab6a379 (its total_s); needs 2 GPUs"),
)
# fmt: on
PARTS = ("1", "2", "3", "x2")
#: ``<stem>_<machine>_<commit>.<ext>``: a file this script writes (or its kernel_targets .md)
NAME_RE = re.compile(r"^(?P<stem>[a-z0-9_]+?)_(?P<machine>h[12]00(?:x2)?)_"
                     r"(?P<commit>[0-9a-f]{7,40})\.(?P<ext>json|md)$")  # fmt: skip


def stems() -> set[str]:
    """Every stem a part writes, its log's included."""
    return {s.stem for s in STEPS} | {f"headline_part{p}" for p in PARTS}


def current(stem: str, results: Path = RESULTS, machine: str | None = None) -> str | None:
    """The name of the current ``<stem>_<machine>_<commit>.json`` in ``results``: the one there
    (the adopt step keeps one per stem), or the newest by its own ``date`` if several are."""
    found = []
    for path in results.glob(f"{stem}_*.json"):
        m = NAME_RE.match(path.name)
        if m and m["stem"] == stem and (machine is None or m["machine"] == machine):
            try:
                date = str(json.loads(path.read_text()).get("date", ""))
            except (OSError, ValueError):
                date = ""
            found.append((date, path.name))
    return max(found)[1] if found else None


def commit7() -> str:
    """The commit a part records, 7 hex digits: :func:`poetxq.tools.bench.git_commit`'s
    (``$POETXQ_COMMIT``, else ``.commit`` beside a snapshot, else git's HEAD), else
    ``unknown``."""
    from poetxq.tools.bench import git_commit

    return (git_commit(REPO) or "unknown").strip()[:7]


def command(
    step: Step, out_dir: Path, commit: str, official: str | None, gpu: str | None = None
) -> list[str] | None:
    """The argv of ``step`` (``python`` first), or None when it needs the official code and
    none was given; ``gpu``: the card's name, for the output file's (:meth:`Step.out_name`)."""
    if step.official == "needs" and not official:
        return None
    argv = [sys.executable, *step.argv]
    if step.stem == "gpu_tests":
        if _has("xdist"):  # 16 cores on the H200 host: the compiles run side by side
            argv += ["-n", "6", "--dist", "loadfile"]
        if _has("pytest_timeout"):  # one stalled test does not take the whole part
            argv += ["--timeout", "240"]
        return argv
    argv += ["--out", str(out_dir / step.out_name(commit, gpu))]
    if official and step.official:
        argv += ["--official", official]
    return argv


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _shell(argv: list[str], env: dict[str, str]) -> str:
    text = " ".join(a if re.fullmatch(r"[\w@%+=:,./-]+", a) else repr(a) for a in argv)
    text = text.replace(sys.executable, "python", 1)
    return " ".join([*(f"{k}={v}" for k, v in env.items()), text])


def _run(argv: list[str], env: dict[str, str], timeout: float) -> dict:
    """Run ``argv`` in its own process group, echoing its output; kill the group at
    ``timeout``. Returns exit status, wall seconds, whether it timed out and the output's tail."""
    tail: collections.deque[str] = collections.deque(maxlen=400)
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)  # fmt: skip

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        timed_out = True
        with_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with_group(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=5)
    return {"returncode": proc.returncode, "wall_s": round(time.monotonic() - start, 1),
            "timed_out": timed_out, "output_tail": "".join(tail)}  # fmt: skip


def with_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group that ``pid`` leads (the command and its children)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _test_log(path: Path | None) -> dict:
    """What ``POETXQ_TEST_LOG`` (tests/conftest.py) recorded as the tests ran: how many tests
    finished, each failure with its error, the slowest tests. Read even when pytest was cut
    off before its own summary; under pytest-xdist a report may come twice (kept once)."""
    if path is None or not path.is_file():
        return {}
    seen: dict[tuple[str, str], dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rec = json.loads(line)
            seen[(rec["test"], rec["when"])] = rec
    calls = [r for r in seen.values() if r["when"] == "call"]
    slow = sorted(calls, key=lambda r: -r["seconds"])[:15]
    per_file: dict[str, float] = {}
    for r in calls:  # pytest-xdist's --dist loadfile runs a file on one worker: its longest pole
        name = r["test"].split("::")[0]
        per_file[name] = per_file.get(name, 0.0) + r["seconds"]
    return {
        "tests_run": len(calls),
        "failed_tests": [r for r in seen.values() if r["outcome"] == "failed"],
        "slowest": [{"test": r["test"], "seconds": r["seconds"]} for r in slow],
        "slowest_files": [
            {"file": f, "seconds": round(t, 1)}
            for f, t in sorted(per_file.items(), key=lambda kv: -kv[1])[:15]
        ],
        "calls_seconds": round(sum(r["seconds"] for r in calls), 1),
    }


def pytest_record(
    res: dict, argv: list[str], commit: str, gpu: str, test_log: Path | None = None
) -> dict:
    """The GPU test record: pytest's summary line, its counts, duration, the FAILED lines, and
    from ``test_log`` (:func:`_test_log`) the failures' errors and the slowest tests."""
    lines = [ln for ln in res["output_tail"].splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if re.search(r" in [\d.]+s", ln)), "")
    counts = {k.rstrip("s") if k.startswith("error") else k: int(n)
              for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|"
                                     r"deselected|warnings?)", summary)}  # fmt: skip
    dur = re.search(r" in ([\d.]+)s", summary)
    return {
        "what": "the whole test suite on the GPU (pytest -m 'slow or not slow')",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpu": gpu,
        "commit": commit,
        "command": _shell(argv, {}),
        "returncode": res["returncode"],
        "timed_out": res["timed_out"],
        "summary": summary.strip("= "),
        "counts": counts,
        "duration_s": float(dur[1]) if dur else None,
        "wall_s": res["wall_s"],
        "failures": [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))],
        **_test_log(test_log),
        "output_tail": res["output_tail"][-4000:],
    }


def _gpu_name() -> str:
    res = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name"
                          "() if torch.cuda.is_available() else 'cpu')"],
                         capture_output=True, text=True, check=False)  # fmt: skip
    return res.stdout.strip() or "?"


def plan(part: str, only: set[str] | None = None) -> list[Step]:
    """The steps of ``part`` in order (``only``: those stems alone)."""
    return [s for s in STEPS if s.part == part and (not only or s.stem in only)]


def run_part(
    part: str,
    out_dir: Path,
    official: str | None,
    budget: float,
    dry: bool,
    only: set[str] | None = None,
) -> dict:
    """Run (or, ``dry``, print) one part's commands (``only``: those stems) within ``budget``
    seconds."""
    commit = commit7()
    start = time.monotonic()
    deadline = start + budget - MARGIN_S
    log = {"what": f"evals/headline.py part {part}", "part": part, "commit": commit,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_s": budget,
           "official": official, "steps": []}  # fmt: skip
    gpu = None if dry else _gpu_name()  # the card names the files (machine_tag)
    machine = machine_tag(plan(part)[0].machine, gpu)
    log_name = f"headline_part{part}_{machine}_{commit}.json"
    log["gpu"] = gpu
    for step in plan(part, only):
        argv = command(step, out_dir, commit, official, gpu)
        writes = step.out_name(commit, gpu)
        entry = {"stem": step.stem, "writes": writes, "est_s": step.est_s}
        if argv is None:
            entry["skipped"] = "needs the official code (--official DIR)"
            print(f"[part {part}] skip {step.stem}: {entry['skipped']}", flush=True)
            log["steps"].append(entry)
            continue
        entry["command"] = _shell(argv, step.env)
        left = deadline - time.monotonic()
        timeout = min(step.timeout_s, left)
        if dry:
            print(f"[part {part}] {entry['command']}\n    writes {writes} "
                  f"(estimate {step.est_s} s, timeout {step.timeout_s} s)")  # fmt: skip
            continue
        if left < MIN_SHARE * step.est_s:
            entry["skipped"] = f"{left:.0f} s left of the part's budget, estimate {step.est_s} s"
            print(f"[part {part}] skip {step.stem}: {entry['skipped']}", flush=True)
            log["steps"].append(entry)
            continue
        print(f"[part {part}] {entry['command']}  (timeout {timeout:.0f} s)", flush=True)
        env = {**step.env, "POETXQ_COMMIT": commit}
        test_log = None  # the suite's per-test log (tests/conftest.py), read into its record
        if step.stem == "gpu_tests":
            test_log = out_dir / f".{step.stem}_{commit}.jsonl"
            test_log.unlink(missing_ok=True)
            env["POETXQ_TEST_LOG"] = str(test_log.absolute())
        res = _run(argv, env, timeout)
        entry.update({k: res[k] for k in ("returncode", "wall_s", "timed_out")})
        if test_log is not None:
            rec = pytest_record(res, argv, commit, gpu or "?", test_log)
            test_log.unlink(missing_ok=True)
            (out_dir / writes).write_text(json.dumps(rec, indent=1) + "\n")
            entry["summary"] = rec["summary"]
        if res["returncode"] != 0 or not (out_dir / writes).is_file():
            entry["output_tail"] = res["output_tail"][-3000:]
        entry["wrote"] = (out_dir / writes).is_file()
        log["steps"].append(entry)
        log["wall_s"] = round(time.monotonic() - start, 1)
        (out_dir / log_name).write_text(json.dumps(log, indent=1) + "\n")  # after every step
    if dry:
        total = sum(s.est_s for s in plan(part, only) if command(s, out_dir, commit, official))
        print(f"[part {part}] estimated {total} s (unmeasured), budget {budget:.0f} s; "
              f"log {log_name}")  # fmt: skip
        return log
    log["wall_s"] = round(time.monotonic() - start, 1)
    (out_dir / log_name).write_text(json.dumps(log, indent=1) + "\n")
    print(f"[part {part}] done in {log['wall_s']} s; wrote {out_dir / log_name}", flush=True)
    return log


def adopt(src: Path, results: Path = RESULTS, git: bool = True) -> list[str]:
    """Copy the files of ``src`` this script writes into ``results`` and remove the files of the
    same stem and machine they supersede (``git rm`` when tracked). A file older (by its
    ``date``) than the one there is left out. Returns what changed, one line each."""
    known, done = stems(), []
    for path in sorted(src.iterdir()):
        m = NAME_RE.match(path.name)
        if not m or m["stem"] not in known or m["ext"] != "json":
            continue
        stem, machine = m["stem"], m["machine"]
        here = current(stem, results, machine)
        if here and here != path.name and _date(results / here) > _date(path):
            done.append(f"kept {here}: newer than {path.name}")
            continue
        shutil.copyfile(path, results / path.name)
        done.append(f"added {path.name}")
        if stem == "kernel_targets":
            md = results / path.name.replace(".json", ".md")
            subprocess.run([sys.executable, str(REPO / "evals" / "kernel_targets.py"), "--render",
                            str(results / path.name), "--md", str(md)],
                           check=False, capture_output=True)  # fmt: skip
            md.write_text(md.read_text().replace(str(results) + "/", "evals/results/"))
        for old in sorted(results.iterdir()):
            mo = NAME_RE.match(old.name)
            if (mo and mo["stem"] == stem and mo["machine"] == machine
                    and old.stem != path.name.removesuffix(".json")):  # fmt: skip
                _remove(old, git)
                done.append(f"removed {old.name}")
    return done


def _date(path: Path) -> str:
    try:
        return str(json.loads(path.read_text()).get("date", ""))
    except (OSError, ValueError):
        return ""


def _remove(path: Path, git: bool) -> None:
    if git:
        res = subprocess.run(["git", "-C", str(path.parent), "rm", "-q", "-f", "--", path.name],
                             capture_output=True, check=False)  # fmt: skip
        if res.returncode == 0:
            return
    path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--part", choices=(*PARTS, "all"), help="which part to run ('all': 1, 2, 3)")
    ap.add_argument("--out-dir", default=os.environ.get("OUT"),
                    help="where the files go (default $OUT)")  # fmt: skip
    ap.add_argument("--official", default=None, metavar="DIR",
                    help="a local copy of the official POET code (its poet_torch/): the official "
                    "8B / 13B steps (part 2) and layers (part 3)")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=PART_BUDGET_S,
                    help="wall seconds of one part (default %(default)s)")  # fmt: skip
    ap.add_argument("--only", default="", metavar="STEM,...",
                    help="run only these stems of the part (e.g. gpu_tests, to run the suite "
                    "again on its own)")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true",
                    help="print each command and the file it writes; run nothing")  # fmt: skip
    ap.add_argument("--adopt", metavar="DIR", help="copy DIR's files into evals/results/, git rm "
                    "the ones they supersede; then run python evals/render_results.py")  # fmt: skip
    args = ap.parse_args(argv)
    if args.adopt:
        if args.part:
            ap.error("give --adopt DIR or --part, not both")
        src = Path(args.adopt)
        if not src.is_dir():
            ap.error(f"--adopt {src}: not a folder")
        for line in adopt(src):
            print(line)
        print("now: python evals/render_results.py")
        return 0
    if not args.part:
        ap.error("give --part 1|2|3|x2|all (or --adopt DIR)")
    if args.official and not Path(args.official).is_dir():
        ap.error(f"--official {args.official}: not a folder")
    if not args.out_dir:
        if not args.dry_run:
            ap.error("--out-dir: none given and $OUT is unset")
        args.out_dir = "OUT"
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    if only - {s.stem for s in STEPS}:
        ap.error(f"--only: unknown {sorted(only - {s.stem for s in STEPS})}")
    if not args.dry_run and not re.fullmatch(r"[0-9a-f]{7}", commit7()):
        ap.error("no commit: set POETXQ_COMMIT (the device's copy of the tree has no .git)")
    out = Path(args.out_dir)
    if not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)
    official = str(Path(args.official).resolve()) if args.official else None
    parts = ("1", "2", "3") if args.part == "all" else (args.part,)
    failed = 0
    for part in parts:
        if only and not plan(part, only):
            continue
        log = run_part(part, out, official, args.budget_s, args.dry_run, only)
        failed += sum(1 for s in log["steps"] if s.get("returncode") not in (None, 0))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
