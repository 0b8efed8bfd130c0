"""Multi-process training: rank-sharded data order, the int8 weights' gradient all-reduce, and
2-process DDP over gloo against 1 process with the same global batch (real CLI, torchrun)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hosts import child_env

from poetxq.data.config import DataError
from poetxq.training.distributed import (
    ShardedBatches,
    all_reduce_float_grads,
    broadcast_module,
    replicas_identical,
)

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------
# data order
# ------------------------------------------------------------------------------------------------


def test_shards_cover_each_epoch_once_and_match_one_process():
    windows = torch.arange(23).unsqueeze(1).repeat(1, 3)  # 23 windows: 2 global batches of 8
    one = ShardedBatches(windows, 8, rank=0, world_size=1, seed=5)
    two = [ShardedBatches(windows, 4, rank=r, world_size=2, seed=5) for r in (0, 1)]
    assert len(one) == len(two[0]) == 2
    for epoch in range(3):
        seen = []
        for k in range(2):
            pos = epoch * 2 + k
            full = one.batch(pos)[:, 0]
            halves = [s.batch(pos)[:, 0] for s in two]
            # the global batch of 1 process = rank 0's rows followed by rank 1's rows
            assert torch.equal(full, torch.cat(halves))
            seen += full.tolist()
        assert len(seen) == len(set(seen)) == 16  # no window twice in an epoch, ranks disjoint
        assert torch.equal(one.epoch_order(epoch).sort().values, torch.arange(23))
    assert not torch.equal(one.epoch_order(0), one.epoch_order(1))  # reshuffled every epoch


def test_iteration_resumes_at_any_position():
    windows = torch.arange(40).unsqueeze(1)
    s = ShardedBatches(windows, 3, rank=1, world_size=2, seed=0)
    it = s.iterate(0)
    stream = [next(it) for _ in range(20)]  # crosses 3 epochs (6 batches each)
    fresh = ShardedBatches(windows, 3, rank=1, world_size=2, seed=0).iterate(13)
    for i in range(13, 20):
        assert torch.equal(next(fresh), stream[i])


def test_too_few_windows_for_one_global_batch():
    with pytest.raises(DataError, match="fewer than one global batch"):
        ShardedBatches(torch.zeros(7, 4, dtype=torch.long), 4, rank=0, world_size=2, seed=0)


# ------------------------------------------------------------------------------------------------
# gradient all-reduce of the int8 weights' float_grad (2 processes, gloo)
# ------------------------------------------------------------------------------------------------


def _reduce_worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    # integer-valued grads: the mean is exact in fp32, so equality is the right check
    grads = [torch.full((3, 5), float(rank * 10 + 1)), torch.arange(7.0) * (rank + 1)]
    all_reduce_float_grads(grads)
    torch.manual_seed(0)
    same = replicas_identical(torch.nn.Linear(4, 3))
    torch.manual_seed(rank)
    differ = not replicas_identical(torch.nn.Linear(4, 3))
    torch.save({"grads": grads, "same": same, "differ": differ}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_float_grads_are_averaged_once(tmp_path):
    out = str(tmp_path / "res")
    mp.spawn(_reduce_worker, args=(f"file://{tmp_path / 'store'}", out), nprocs=2)
    for rank in (0, 1):
        res = torch.load(f"{out}.{rank}", weights_only=True)
        assert torch.equal(res["grads"][0], torch.full((3, 5), 6.0))  # (1 + 11) / 2
        assert torch.equal(res["grads"][1], torch.arange(7.0) * 1.5)  # (1x + 2x) / 2
        assert res["same"] and res["differ"]  # the replica check tells equal from unequal


def _broadcast_worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(rank)  # the ranks start different
    module = torch.nn.Linear(4, 3)
    module.register_buffer("codes", torch.randint(-127, 127, (5,), dtype=torch.int8))
    module.register_buffer("mask", torch.rand(6) > 0.5)
    broadcast_module(module)
    torch.save(module.state_dict(), f"{out}.{rank}")
    dist.destroy_process_group()


def test_broadcast_module_copies_rank0(tmp_path):
    """Parameters and buffers (int8, bool) of rank 0 reach rank 1 (train.grad_sync: step)."""
    out = str(tmp_path / "res")
    mp.spawn(_broadcast_worker, args=(f"file://{tmp_path / 'store'}", out), nprocs=2)
    s0, s1 = (torch.load(f"{out}.{r}", weights_only=True) for r in (0, 1))
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    assert torch.equal(s0["weight"], ref.weight.detach())  # rank 0 unchanged
    for key in ("weight", "bias", "codes", "mask"):
        assert torch.equal(s0[key], s1[key]), key


# ------------------------------------------------------------------------------------------------
# 2-process DDP over gloo vs 1 process, same global batch (the real CLI)
# ------------------------------------------------------------------------------------------------

COMMON = [
    "--data", "pydoc", "--vocab-size", "512", "--seq-len", "32", "--set", "poet.block_size=16",
    "--eval-every", "100", "--no-progress", "--max-steps", "8", "--set", "poet.merge_interval=3",
    "--save-every", "4", "--set", "model.hidden_size=64", "--set", "model.intermediate_size=136",
    "--set", "model.num_attention_heads=4", "--set", "model.num_hidden_layers=2",
    "--set", "train.log_every=1", "--set", "optim.warmup_steps=3",
]  # fmt: skip
METHODS = {
    "poetxq": [],  # merges at steps 3 and 6 must give the same W0 and permutations on both ranks
    # int8 weights whose gradients DDP does not see (float_grad); 2 micro-batches per step
    "qapollo": ["--recipe", str(ROOT / "recipes/tiny/qapollo.yaml"), "--set", "baseline.rank=8",
                "--set", "baseline.update_proj_gap=3", "--set", "baseline.weight_group_size=64",
                "--grad-accum", "2"],
    # no DDP wrapper: each rank's gradients all-reduced once per step after its micro-steps
    # (what a CUDA graph needs on a GPU; here on gloo), with merges and 2 micro-batches
    "poetxq_step": ["--set", "train.grad_sync=step", "--grad-accum", "2"],
    # the chunked loss calls the bare model: grad_sync auto resolves to step for it
    "poetxq_chunked": ["--set", "train.loss_chunk_tokens=24"],
}  # fmt: skip
#: the grad sync each 2-process run reports
SYNC = {"poetxq": "ddp", "qapollo": "ddp", "poetxq_step": "step", "poetxq_chunked": "step"}
#: per-step relative loss difference allowed between 1 and 2 processes: the same math, but the
#: 2-process gradient is the mean of two half-batch means (fp32 sums in another order); measured
#: <= 1.4e-6 over 8 steps
RTOL = 1e-5


def _run(args: list[str], nproc: int, cache: Path) -> subprocess.CompletedProcess:
    # gloo on the CPU, also on a GPU host (two ranks would share its one GPU)
    env = child_env(POETXQ_CACHE=str(cache), CUDA_VISIBLE_DEVICES="")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}", "-m", "poetxq"] if nproc > 1 else [
                sys.executable, "-m", "poetxq"]  # fmt: skip
    proc = subprocess.run([*launcher, "train", *args], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "lr" in r}


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_two_processes_match_one_with_the_same_global_batch(tmp_path, tmp_path_factory, method):
    cache = tmp_path_factory.getbasetemp() / "data-cache"
    accum = 2 if "--grad-accum" in METHODS[method] else 1
    per_rank = 8 // accum // 2  # global batch 8 windows per step in both runs
    base = [*COMMON, *METHODS[method], "--output-dir", str(tmp_path)]
    _run([*base, "--run-name", "one", "--batch-size", str(2 * per_rank)], 1, cache)
    proc = _run([*base, "--run-name", "two", "--batch-size", str(per_rank)], 2, cache)
    assert f"grad sync: {SYNC[method]} across 2 processes" in proc.stdout
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == list(range(1, 9))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=RTOL), step
    s1, s2 = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("one", "two"))
    assert s2["num_processes"] == 2 and s2["replicas_identical"] is True
    assert s1["tokens"] == s2["tokens"] and s1["merges"] == s2["merges"]
    # only rank 0 writes: one metrics line per step, and each checkpoint once
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == [
        "step-00000004", "step-00000008",
    ]  # fmt: skip

    if method == "poetxq":  # resume under DDP continues exactly (same 2-process losses)
        again = tmp_path / "again"
        shutil.copytree(tmp_path / "two", again)
        shutil.rmtree(again / "checkpoints" / "step-00000008")
        (again / "model.safetensors").unlink()
        _run(["--resume", str(again), "--no-progress"], 2, cache)
        assert _losses(again) == two
        assert (again / "model.safetensors").read_bytes() == (
            tmp_path / "two" / "model.safetensors"
        ).read_bytes()


@pytest.mark.slow
def test_two_processes_build_the_same_model_with_meta_init(tmp_path, tmp_path_factory, monkeypatch):
    """The CUDA way of building (meta init), taken on the CPU: each rank builds its own model and
    DDP does not broadcast the frozen W0 buffers, so they must be drawn identically — the final
    replica check agrees after merges at steps 3 and 6, and 2 processes match 1."""
    monkeypatch.setenv("POETXQ_META_INIT", "1")  # _run passes the environment on
    cache = tmp_path_factory.getbasetemp() / "data-cache"
    base = [*COMMON, "--output-dir", str(tmp_path)]
    one = _run([*base, "--run-name", "one", "--batch-size", "8"], 1, cache)
    _run([*base, "--run-name", "two", "--batch-size", "4"], 2, cache)
    assert "(meta init: " in one.stdout
    l1, l2 = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(l1) == sorted(l2) == list(range(1, 9))
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=RTOL), step
    s2 = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert s2["num_processes"] == 2 and s2["replicas_identical"] is True and s2["merges"] == 2


def test_stop_signals_take_a_double_tap_as_one_and_a_later_ctrl_c_as_abort(monkeypatch, capsys):
    """The first SIGINT asks for a clean stop (and says so with ``announce``); a second within
    the grace period is a double tap and ignored; one after it raises KeyboardInterrupt."""
    import signal

    import poetxq.training.distributed as dist_mod
    from poetxq.training.distributed import StopSignals

    now = {"t": 100.0}
    monkeypatch.setattr(dist_mod.time, "monotonic", lambda: now["t"])
    stop = StopSignals(grace_s=1.0, announce=True)
    with stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGINT
        now["t"] += 0.3
        os.kill(os.getpid(), signal.SIGINT)  # double tap: still a clean stop
        assert stop.received == signal.SIGINT
        now["t"] += 1.0
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["poetxq: SIGINT: stopping after this step (checkpoint and summary); Ctrl-C "
                   "again to abort at once"]  # fmt: skip
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored on exit
    with StopSignals(grace_s=1.0, announce=True) as term:  # a SIGTERM: Ctrl-C is not "again"
        os.kill(os.getpid(), signal.SIGTERM)
        assert term.received == signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["poetxq: SIGTERM: stopping after this step (checkpoint and summary); Ctrl-C "
                   "to abort at once"]  # fmt: skip
