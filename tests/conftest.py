import os

import torch

# Without a GPU, Triton kernels are tested through Triton's CPU interpreter; it must be chosen
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import signal

import pytest

# A shell that starts a command in the background (`cmd &`, as CI wrappers may) hands it SIGINT
# ignored; the interrupt tests need Python's own Ctrl-C handler, as in an interactive run.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Keep CPU tests reproducible and light on the 2-core CI machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _plain_rotary() -> None:
    """Every test starts with transformers' plain rotary function: a training run on a GPU
    compiles it for the whole process (poetxq.model.fuse), and a later test in the same process
    would otherwise run (and count) the compiled one."""
    from poetxq.model.fuse import unfuse_elementwise

    unfuse_elementwise(torch.nn.Module())


@pytest.fixture
def cpu_only():
    """The test sees a host without a GPU (tests/hosts.py: cpu_host)."""
    from hosts import cpu_host

    with cpu_host():
        yield


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _tiny_train(tmp_path, name: str, *extra: str) -> tuple[list[float], list[dict]]:
    """``poetxq train`` of a 2-layer Llama (d 64, ragged MLP 136, b 16) on pydoc for 3 steps,
    merging every 2, logging every step, into ``tmp_path/name``; ``extra`` flags go last.
    Returns the per-step training losses and every metrics.jsonl record."""
    import json

    from poetxq.tools.cli import main

    args = [
        "train", "--data", "pydoc", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4",
        "--max-steps", "3", "--eval-every", "20", "--no-progress", "--output-dir", str(tmp_path),
        "--run-name", name, "--set", "poet.block_size=16", "--set", "model.hidden_size=64",
        "--set", "model.intermediate_size=136", "--set", "model.num_attention_heads=4",
        "--set", "model.num_hidden_layers=2", "--set", "train.log_every=1",
        "--set", "poet.merge_interval=2", *extra,
    ]  # fmt: skip
    assert main(args) == 0
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "grad_norm" in r], rows


@pytest.fixture
def tiny_train(tmp_path, monkeypatch):
    """:func:`_tiny_train` bound to this test's ``tmp_path``, with the data cache inside it."""
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "data-cache"))
    return lambda name, *extra: _tiny_train(tmp_path, name, *extra)


_TEST_LOG = os.environ.get("POETXQ_TEST_LOG")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``POETXQ_TEST_LOG=FILE``: one JSON line per test (outcome, seconds, the error of a
    failure) and per failed setup or teardown, written as it happens, so a run cut off by a
    device call's time limit still says which tests failed and why (pytest's own summary comes
    only at the end)."""
    if not _TEST_LOG or (report.when != "call" and report.passed):
        return
    import json

    rec = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
           "seconds": round(report.duration, 2)}  # fmt: skip
    if report.failed:
        text = str(report.longrepr)  # where it failed (the head) and why (the tail)
        rec["error"] = text if len(text) <= 6000 else f"{text[:1500]}\n[...]\n{text[-4500:]}"
    with open(_TEST_LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
