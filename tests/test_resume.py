"""Exact resume of the real CLI: a run killed with SIGKILL (or stopped with SIGTERM) at a random
step and resumed logs the same per-step losses, bit for bit, as an uninterrupted run, and ends
with byte-identical weights (fp32, deterministic algorithms, one thread)."""

import contextlib
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hosts import child_env

from poetxq.training.checkpoint import list_checkpoints

ROOT = Path(__file__).resolve().parents[1]

# one-thread, deterministic torch, then the CLI
PRELUDE = (
    "import sys, torch; torch.set_num_threads(1); torch.use_deterministic_algorithms(True); "
    "from poetxq.tools.cli import main; sys.exit(main())"  # a process: its exit status
)
MAX_STEPS, SAVE_EVERY, MERGE_INTERVAL = 16, 4, 3  # saves at 4, 8, 12; merges at 3, 6, 9, 12, 15
COMMON = [
    "--data", "pydoc", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "8",
    "--set", "poet.block_size=16", "--eval-every", "100", "--no-progress",
    "--max-steps", str(MAX_STEPS),
    "--save-every", str(SAVE_EVERY), "--set", f"poet.merge_interval={MERGE_INTERVAL}",
    "--set", "model.hidden_size=64", "--set", "model.intermediate_size=136",
    "--set", "model.num_attention_heads=4", "--set", "model.num_hidden_layers=2",
    "--set", "train.log_every=1", "--set", "optim.warmup_steps=4", "--set", "train.precision=fp32",
]  # fmt: skip
METHODS = {
    "poetxq": [],
    # projection refresh every 3 steps, lazy refresh queue, INT4 projector, 8-bit states and
    # stochastic rounding of the int8 weights: all of it must resume exactly
    "qgalore": ["--recipe", str(ROOT / "recipes/tiny/qgalore.yaml"), "--set", "baseline.rank=8",
                "--set", "baseline.update_proj_gap=3", "--set", "baseline.queue_size=2",
                "--set", "baseline.weight_group_size=64", "--set", "baseline.cos_threshold=-1"],
}  # fmt: skip


def _env(cache: Path) -> dict:
    return child_env(POETXQ_CACHE=str(cache), CUDA_VISIBLE_DEVICES="")  # the CPU's exactness


def _cli(args: list[str], env: dict, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-c", PRELUDE, "train", *args]
    pipe = subprocess.PIPE
    return subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True, **kw)


def _records(run: Path) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            out.append(json.loads(line))
    return out


def _losses(run: Path) -> list[tuple[int, float]]:
    """(step, loss) of every per-step training record, in file order."""
    return [(r["step"], r["loss"]) for r in _records(run) if "lr" in r]


def _last_step(run: Path) -> int:
    if not (run / "metrics.jsonl").exists():
        return 0
    steps = [s for s, _ in _losses(run)]
    return max(steps, default=0)


def _stop_at(run: Path, proc: subprocess.Popen, target: int, sig: signal.Signals) -> int:
    """Send ``sig`` once the run has logged step ``target``; returns the last logged step."""
    deadline = time.time() + 120
    while _last_step(run) < target:
        assert proc.poll() is None, f"run ended before step {target}: {proc.communicate()[1]}"
        assert time.time() < deadline, "run too slow"
        time.sleep(0.005)
    proc.send_signal(sig)
    return _last_step(run)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, one per method: run directories under one temp dir."""
    base = tmp_path_factory.mktemp("reference")
    env = _env(tmp_path_factory.getbasetemp() / "data-cache")
    runs = {}
    for method, extra in METHODS.items():
        proc = _cli([*COMMON, *extra, "--output-dir", str(base), "--run-name", method], env)
        _out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        runs[method] = base / method
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_sigkill_then_resume_is_bit_exact(reference, tmp_path, tmp_path_factory, method):
    ref = reference[method]
    env = _env(tmp_path_factory.getbasetemp() / "data-cache")
    target = random.SystemRandom().choice([6, 10])  # a merge (6 / 9) lies after the save (4 / 8)
    proc = _cli([*COMMON, *METHODS[method], "--output-dir", str(tmp_path), "--run-name", "r"], env)
    run = tmp_path / "r"
    killed_after = _stop_at(run, proc, target, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    saved = list_checkpoints(run)[-1][0]
    assert saved < killed_after < MAX_STEPS, (saved, killed_after)
    if method == "poetxq":  # the resumed run has to redo a merge it had done before the kill
        merges = [s for s in range(saved + 1, killed_after + 1) if s % MERGE_INTERVAL == 0]
        assert merges, (saved, killed_after)

    proc = _cli(["--resume", str(run), "--no-progress"], env)  # the recipe comes from the run
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert f"resumed from {run}/checkpoints/step-{saved:08d}" in err + _out

    got, want = _losses(run), _losses(ref)
    assert got == want, f"killed after step {killed_after}, resumed at {saved}"
    assert [s for s, _ in got] == list(range(1, MAX_STEPS + 1))  # each step logged once
    assert (run / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    summary, ref_summary = (json.loads((d / "summary.json").read_text()) for d in (run, ref))
    assert summary["final_val_ppl"] == ref_summary["final_val_ppl"]
    assert summary["merges"] == ref_summary["merges"]
    assert summary["resumed_from"] == [saved] and not summary["interrupted"]


@pytest.mark.slow
def test_sigterm_saves_marks_interrupted_and_resumes_exactly(reference, tmp_path,
                                                             tmp_path_factory):  # fmt: skip
    ref = reference["poetxq"]
    env = _env(tmp_path_factory.getbasetemp() / "data-cache")
    proc = _cli([*COMMON, "--output-dir", str(tmp_path), "--run-name", "r"], env)
    run = tmp_path / "r"
    _stop_at(run, proc, 5, signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    stopped = summary["steps"]
    assert summary["interrupted"] and summary["stop_signal"] == "SIGTERM" and 5 <= stopped < 16
    assert list_checkpoints(run)[-1][0] == stopped  # saved at the step it stopped after
    assert _records(run)[-1] == {"step": stopped, "event": "interrupted", "signal": "SIGTERM"}
    assert f"--resume {run}" in err.strip().splitlines()[-1]

    proc = _cli(["--resume", str(run), "--no-progress"], env)
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert _losses(run) == _losses(ref)
    assert (run / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    events = [r for r in _records(run) if "event" in r]
    assert [e["event"] for e in events] == ["interrupted", "resumed"]
    # the resumed session's recipe names the plan; auto chose it at the start, as in the reference
    plans = [json.loads((d / "summary.json").read_text())["memory_plan"] for d in (run, ref)]
    assert plans[0]["name"] == plans[1]["name"] == "fastest"
    assert plans[0]["chosen_by"] == plans[1]["chosen_by"] == "auto"
