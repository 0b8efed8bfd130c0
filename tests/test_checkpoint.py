"""Training checkpoints: exact state round trip per optimizer, atomic writes that survive a kill
half-way, pruning, and bad ``--resume`` input (one line, exit 2, nothing overwritten)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hosts import child_env
from torch import nn

from poetxq.model.layer import POETXLinear
from poetxq.tools.cli import main
from poetxq.training.baseline_methods import build_baseline_optimizer, prepare_baseline
from poetxq.training.checkpoint import (
    CheckpointError,
    decode_state,
    encode_state,
    latest_checkpoint,
    list_checkpoints,
    load_training_checkpoint,
    save_training_checkpoint,
)
from poetxq.training.optim import build_optimizer, build_scheduler, merge_and_reset
from poetxq.training.recipe import BaselineConfig, OptimConfig

ROOT = Path(__file__).resolve().parents[1]


class Tiny(nn.Module):
    """Two projections named like Llama's (so the baselines target them) and a norm weight."""

    def __init__(self, poet: bool, gen: torch.Generator, structure: str = "block") -> None:
        super().__init__()
        if poet:
            kw = {"block_size": 8, "bits": 8, "generator": gen, "stochastic_requant": True,
                  "structure": structure}  # fmt: skip
            self.q_proj, self.up_proj = POETXLinear(24, 40, **kw), POETXLinear(40, 24, **kw)
        else:
            self.q_proj, self.up_proj = nn.Linear(24, 40, bias=False), nn.Linear(40, 24)
        self.norm = nn.Parameter(torch.ones(24))
        self.emb = nn.Parameter(0.1 * torch.randn(24, 24, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up_proj(torch.tanh(self.q_proj(x @ self.emb))) * self.norm


def _setup(method: str):
    """A fresh model + optimizer + scheduler (+ merge generator) for ``method``, seeded."""
    torch.manual_seed(0)  # nn.Linear init
    gen = torch.Generator().manual_seed(7)
    oc = OptimConfig(lr=0.02, poet_lr=0.05, warmup_steps=2, state_bits=8 if "8" in method else 32)
    model = Tiny(method.startswith("poetxq"), gen, "full" if method.endswith("-fs") else "block")
    if method.startswith("poetxq"):
        opt = build_optimizer(model, oc)
        if oc.state_bits == 8:  # 8-bit codes for these small tensors too (default: >= 4096)
            opt.args.min_8bit_size = 64
    else:
        cfg = BaselineConfig(rank=4, update_proj_gap=2, weight_group_size=64, queue_size=2,
                             cos_threshold=-1.0)  # fmt: skip
        opt = build_baseline_optimizer(model, prepare_baseline(model, method, cfg), cfg, oc)
    sched = build_scheduler(opt, oc, 20)
    return model, opt, sched, torch.Generator().manual_seed(11)


def _train(model, opt, sched, merge_gen, steps: range, data_gen: torch.Generator) -> list[float]:
    losses = []
    for t in steps:
        x = torch.randn(16, 24, generator=data_gen)
        loss = (model(x) - x.flip(1)).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if isinstance(model.q_proj, POETXLinear) and t % 2 == 0:
            merge_and_reset(model, opt, merge_gen)
        losses.append(loss.item())
    return losses


def _data_after(steps: int) -> torch.Generator:
    """The data generator of :func:`_train` positioned after ``steps`` steps."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        torch.randn(16, 24, generator=gen)
    return gen


def _save(tmp_path, step, model, opt, sched, merge_gen, keep_last=3):
    return save_training_checkpoint(
        tmp_path, step, model=model, optimizer=opt, scheduler=sched,
        generators={"poet": merge_gen}, loop_state={"step": step}, recipe_yaml="name: t\n",
        keep_last=keep_last,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    ["poetxq", "poetxq-8bit", "poetxq-fs", "qgalore", "qapollo", "galore", "adamw", "muon"],
)
def test_resumed_state_continues_bit_for_bit(tmp_path, method):
    """5 steps, save, 5 more steps; a fresh setup loaded from the checkpoint repeats the last 5
    losses and ends with the same weights, quant state, permutations and optimizer state."""
    model, opt, sched, mg = _setup(method)
    _train(model, opt, sched, mg, range(1, 6), torch.Generator().manual_seed(3))
    torch.manual_seed(99)
    ckpt = _save(tmp_path, 5, model, opt, sched, mg)
    rng_at_save = torch.get_rng_state()
    ref = _train(model, opt, sched, mg, range(6, 11), _data_after(5))

    model2, opt2, sched2, mg2 = _setup(method)
    torch.manual_seed(123)  # a different global RNG state: the checkpoint must restore it
    meta = load_training_checkpoint(ckpt, model=model2, optimizer=opt2, scheduler=sched2,
                                    generators={"poet": mg2})  # fmt: skip
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    assert meta["step"] == 5 and meta["loop"] == {"step": 5}
    got = _train(model2, opt2, sched2, mg2, range(6, 11), _data_after(5))
    assert got == ref
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for k1, k2 in [(s1, s2)] if "state" in s1 else [(s1[k], s2[k]) for k in s1]:  # Muon: 2 inner
        assert k1["param_groups"] == k2["param_groups"]
        _assert_same(k1["state"], k2["state"], "state")


def _assert_same(a, b, path: str) -> None:
    """Nested optimizer state equal: tensors bit for bit, other values and their types."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), path
    else:
        assert a == b and type(a) is type(b), path


def test_state_encoding_keeps_types():
    state = {"state": {0: {"step": 3, "shape": (2, 5), "q": [0.5, -1.0], "t": torch.arange(3)}},
             "groups": [{"betas": (0.9, 0.95), "name": None}]}  # fmt: skip
    tensors: dict = {}
    meta = json.loads(json.dumps(encode_state(state, "o", tensors)))
    back = decode_state(meta, tensors)
    assert back["state"][0]["shape"] == (2, 5) and back["groups"][0]["betas"] == (0.9, 0.95)
    assert list(back["state"]) == [0] and back["state"][0]["q"] == [0.5, -1.0]
    assert torch.equal(back["state"][0]["t"], torch.arange(3))
    with pytest.raises(CheckpointError, match="cannot store object"):
        encode_state({"x": object()}, "o", {})


def test_keep_last_prunes_only_after_a_complete_save(tmp_path):
    model, opt, sched, mg = _setup("adamw")
    for step in (2, 4, 6):
        _save(tmp_path, step, model, opt, sched, mg, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]
    _save(tmp_path, 6, model, opt, sched, mg, keep_last=2)  # the same step again replaces it
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6]


_KILL_MID_WRITE = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from safetensors.torch import save
    import poetxq.training.checkpoint as ck
    sys.path.insert(0, {tests!r})
    from test_checkpoint import _setup, _save, _train
    model, opt, sched, mg = _setup("qgalore")
    _train(model, opt, sched, mg, range(1, 3), torch.Generator().manual_seed(3))
    _save({run!r}, 2, model, opt, sched, mg)
    _train(model, opt, sched, mg, range(3, 5), torch.Generator().manual_seed(4))

    def half_then_die(tensors, path):  # the optimizer-state file is half written, then SIGKILL
        blob = save(tensors)
        with open(path, "wb") as f:
            f.write(blob[: len(blob) // 2])
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    ck.write_tensors = half_then_die
    _save({run!r}, 4, model, opt, sched, mg)
    """
)


@pytest.mark.slow
def test_write_killed_half_way_leaves_previous_checkpoint_loadable(tmp_path):
    run = tmp_path / "run"
    code = _KILL_MID_WRITE.format(tests=str(ROOT / "tests"), run=str(run))
    env = child_env()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    leftovers = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert leftovers[0].startswith(".tmp-step-00000004-") and leftovers[1:] == ["step-00000002"]
    assert latest_checkpoint(run).name == "step-00000002"

    # the survivor loads and equals the state after 2 steps of an identical run
    model, opt, sched, mg = _setup("qgalore")
    _train(model, opt, sched, mg, range(1, 3), torch.Generator().manual_seed(3))
    model2, opt2, sched2, mg2 = _setup("qgalore")
    load_training_checkpoint(latest_checkpoint(run), model=model2, optimizer=opt2,
                             scheduler=sched2, generators={"poet": mg2})  # fmt: skip
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
    assert torch.equal(mg.get_state(), mg2.get_state())
    _save(run, 3, model2, opt2, sched2, mg2)  # the next save clears the torn temp dir
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-00000002", "step-00000003",
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------------
# bad --resume input through the CLI
# ------------------------------------------------------------------------------------------------

TINY = [
    "--data", "pydoc", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "8",
    "--set", "poet.block_size=16", "--eval-every", "20", "--no-progress",
    "--set", "model.hidden_size=64", "--set", "model.intermediate_size=136",
    "--set", "model.num_attention_heads=4", "--set", "model.num_hidden_layers=1",
    "--set", "train.log_every=1", "--set", "optim.warmup_steps=2",
]  # fmt: skip


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4 (max_steps 6 so it can be resumed)."""
    base = tmp_path_factory.mktemp("resume")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POETXQ_CACHE", str(tmp_path_factory.getbasetemp() / "data-cache"))
        code = main(["train", *TINY, "--output-dir", str(base), "--run-name", "r",
                     "--max-steps", "4", "--save-every", "2"])  # fmt: skip
    assert code == 0
    run = base / "r"
    assert [s for s, _ in list_checkpoints(run)] == [2, 4]
    return run


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("poetxq: error: "), err
    return err[0]


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _finished_line(run: Path, step: int) -> str:
    ppl = json.loads((run / "summary.json").read_text())["final_val_ppl"]
    return (
        f"run '{run}' already finished at step {step} of {step} (train.max_steps): nothing to "
        f"do, nothing written; its summary: {run / 'summary.json'} (final val ppl {ppl:.2f}). "
        "To train further, start a new run"
    )


def test_resume_of_a_finished_run_says_so_and_exits_0(saved_run, capsys, monkeypatch, tmp_path):
    """A finished run is nothing to do, not an error: a requeued job repeating the command line
    that started it (--resume auto) or naming the run (--resume RUN_DIR) gets one line on stdout
    (the run, its last step, its summary), nothing on stderr, exit status 0, and the run
    directory is left byte for byte as it was."""
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "data-cache"))  # nothing is prepared
    before = _snapshot(saved_run)
    line = _finished_line(saved_run, 4)
    auto = ["train", *TINY, "--output-dir", str(saved_run.parent), "--run-name", "r",
            "--max-steps", "4", "--save-every", "2", "--resume", "auto"]  # fmt: skip
    for argv in (auto, ["train", "--resume", str(saved_run), "--no-progress"]):
        assert main(argv) == 0
        out, err = capsys.readouterr()
        assert out.splitlines() == [line] and err == ""
        assert _snapshot(saved_run) == before
    assert not (tmp_path / "data-cache").exists()  # answered before any data work
    # training further is a recipe change, still refused (start a new run)
    assert main(["train", "--resume", str(saved_run), "--max-steps", "6"]) == 2
    assert "differs from the checkpoint's (step-00000004) in train.max_steps: 4 -> 6" in (
        _one_error_line(capsys)
    )
    assert _snapshot(saved_run) == before


def test_resume_writes_the_final_model_of_a_run_stopped_after_its_last_checkpoint(
    saved_run, tmp_path, capsys
):
    """A run killed (or out of disk) between its last checkpoint and its model.safetensors is
    finished by --resume: evaluated and written, no step trained, the checkpoint left as is."""
    run = tmp_path / "r"
    shutil.copytree(saved_run, run)
    final = (run / "model.safetensors").read_bytes()
    summary = json.loads((run / "summary.json").read_text())
    (run / "model.safetensors").unlink()
    (run / "summary.json").unlink()
    ckpt = _snapshot(run / "checkpoints")
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "reached step 4 of 4 but has no final model.safetensors" in out
    assert (run / "model.safetensors").read_bytes() == final  # the same weights, bit for bit
    again = json.loads((run / "summary.json").read_text())
    assert again["steps"] == 4 and again["resumed_from"] == [4]
    assert again["final_val_ppl"] == pytest.approx(summary["final_val_ppl"], rel=1e-6)
    assert _snapshot(run / "checkpoints") == ckpt
    # now it is finished: a second --resume has nothing to do
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines() == [_finished_line(run, 4)]


def test_resume_missing_dir(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path / "nope")]) == 2
    assert "does not exist" in _one_error_line(capsys)


def test_resume_dir_without_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["train", "--resume", str(tmp_path / "empty")]) == 2
    assert "holds no checkpoint" in _one_error_line(capsys)


def test_resume_given_a_checkpoint_points_at_its_run(saved_run, capsys):
    ckpt = sorted((saved_run / "checkpoints").iterdir())[-1]
    assert main(["train", "--resume", str(ckpt), "--no-progress"]) == 2
    err = _one_error_line(capsys)
    assert "is one checkpoint of a run; pass the run directory" in err and str(saved_run) in err


def test_resume_into_a_read_only_run_is_refused_before_work(saved_run, tmp_path, capsys,
                                                            monkeypatch):  # fmt: skip
    import poetxq.paths

    run = tmp_path / "r"  # the run stopped after its step-2 checkpoint: resumable
    shutil.copytree(saved_run, run)
    shutil.rmtree(dict(list_checkpoints(run))[4])
    real = poetxq.paths.os.access
    ro = str(run.absolute())
    monkeypatch.setattr(poetxq.paths.os, "access", lambda p, m: str(p) != ro and real(p, m))
    before = _snapshot(run)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    assert "is read-only or not writable by this user; copy the run" in _one_error_line(capsys)
    assert _snapshot(run) == before


def test_resume_auto_needs_run_name(capsys):
    assert main(["train", "--resume", "auto"]) == 2
    assert "--run-name" in _one_error_line(capsys)


def test_resume_recipe_mismatch(saved_run, capsys):
    before = _snapshot(saved_run)
    # max_steps changes the LR schedule and optim.lr the updates: neither resumes exactly
    assert main(["train", "--resume", str(saved_run), "--set", "optim.lr=0.1",
                 "--max-steps", "8"]) == 2  # fmt: skip
    line = _one_error_line(capsys)
    assert "optim.lr: 0.005 -> 0.1" in line and "train.max_steps: 4 -> 8" in line
    assert _snapshot(saved_run) == before


def test_resume_takes_the_run_directorys_recipe(saved_run, tmp_path, capsys):
    """``--resume RUN`` reads ``RUN/recipe.yaml``: an edit of a key that may change is used, any
    other edit is refused in one line naming the file and the key (nothing rewritten)."""
    run = tmp_path / "r"
    shutil.copytree(saved_run, run)
    shutil.rmtree(dict(list_checkpoints(run))[4])  # stopped after step 2: resumable
    own = run / "recipe.yaml"
    text = own.read_text()
    own.write_text(text.replace("max_steps: 4", "max_steps: 8"))
    before = _snapshot(run)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    line = _one_error_line(capsys)
    assert (
        f"'{own}' differs from the checkpoint's (step-00000002) in train.max_steps: 4 -> 8" in line
    )
    assert _snapshot(run) == before
    own.write_text(text.replace("log_every: 1", "log_every: 2"))  # resumable: used
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "grad_norm" in r] == [1, 2, 4]  # step 3 not logged
    assert "log_every: 2" in own.read_text()


def test_a_broken_run_recipe_names_the_checkpoints_copy(saved_run, tmp_path, capsys):
    """A run directory's recipe.yaml that no longer parses is one error line that names the
    checkpoint's copy to resume from instead; moving it away resumes from that copy."""
    run = tmp_path / "r"
    shutil.copytree(saved_run, run)
    shutil.rmtree(dict(list_checkpoints(run))[4])  # stopped after step 2: resumable
    (run / "summary.json").unlink()
    own = run / "recipe.yaml"
    own.write_text("train: [unclosed\n")
    before = _snapshot(run)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    line = _one_error_line(capsys)
    copy = run / "checkpoints" / "step-00000002" / "recipe.yaml"
    assert str(own) in line and f"resume with the checkpoint's copy, {copy}" in line
    assert _snapshot(run) == before
    own.rename(tmp_path / "broken.yaml")
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


def test_how_a_step_is_run_is_not_a_recipe_difference():
    from poetxq.training.resume import recipe_differences

    saved = {"train": {"cuda_graph": False, "fuse_elementwise": "auto", "max_steps": 4}}
    now = {"train": {"cuda_graph": "auto", "fuse_elementwise": True, "max_steps": 4}}
    assert recipe_differences(saved, now) == []
    assert recipe_differences(saved, {"train": {**now["train"], "max_steps": 8}}) == [
        "train.max_steps: 4 -> 8"
    ]


def test_resume_with_another_process_count_is_refused(saved_run, tmp_path, capsys):
    run = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(saved_run), str(run)], check=True)
    # make it an unfinished run stopped after its step-2 checkpoint
    subprocess.run(["rm", "-r", str(run / "checkpoints" / "step-00000004")], check=True)
    (run / "summary.json").unlink()
    meta_path = run / "checkpoints" / "step-00000002" / "state.json"
    meta = json.loads(meta_path.read_text())
    meta["loop"]["num_processes"] = 2  # as if written under torchrun --nproc_per_node 2
    meta_path.write_text(json.dumps(meta))
    before = _snapshot(run)
    assert main(["train", "--resume", str(run)]) == 2
    line = _one_error_line(capsys)
    assert "was written by 2 process(es) and this run has 1; resume with 2" in line
    assert _snapshot(run) == before


@pytest.mark.parametrize("victim", ["model.safetensors", "state.safetensors", "state.json"])
def test_resume_corrupted_checkpoint(saved_run, tmp_path, capsys, victim):
    run = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(saved_run), str(run)], check=True)
    path = run / "checkpoints" / "step-00000004" / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    before = _snapshot(run)
    assert main(["train", "--resume", str(run)]) == 2
    line = _one_error_line(capsys)
    assert victim in line and "corrupted" in line and "before it ('step-00000002')" in line
    assert _snapshot(run) == before
    # with no older checkpoint to fall back on, the hint says so
    subprocess.run(["rm", "-r", str(run / "checkpoints" / "step-00000002")], check=True)
    assert main(["train", "--resume", str(run)]) == 2
    assert "it is the run's only checkpoint: start a new run" in _one_error_line(capsys)


@pytest.mark.slow
def test_resume_auto_finds_the_run_or_starts_it(saved_run, capsys, monkeypatch, tmp_path_factory):
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path_factory.getbasetemp() / "data-cache"))
    args = ["train", *TINY, "--output-dir", str(saved_run.parent), "--max-steps", "4",
            "--save-every", "2", "--resume", "auto"]  # fmt: skip
    assert main([*args, "--run-name", "r"]) == 0  # the saved run, already at its last step
    assert capsys.readouterr().out.splitlines() == [_finished_line(saved_run, 4)]
    assert main([*args, "--run-name", "fresh"]) == 0  # no checkpoint yet: a new run
    assert [s for s, _ in list_checkpoints(saved_run.parent / "fresh")] == [2, 4]


def _step1(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r.get("step") == 1 and "grad_norm" in r)


@pytest.mark.slow
def test_gradient_accumulation_averages_like_one_big_batch(tmp_path, monkeypatch):
    # batch 8 in one micro-batch and 2 micro-batches of 4 see the same 8 windows in step 1: the
    # mean loss and the gradient (its norm) agree; the gradient was once divided twice by 2
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "data-cache"))
    base = [a for a in TINY if a not in ("--batch-size", "8")]
    common = [*base, "--output-dir", str(tmp_path), "--max-steps", "1"]
    assert main(["train", *common, "--run-name", "one", "--batch-size", "8"]) == 0
    assert main(["train", *common, "--run-name", "two", "--batch-size", "4",
                 "--set", "train.grad_accum=2"]) == 0  # fmt: skip
    one, two = _step1(tmp_path / "one"), _step1(tmp_path / "two")
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)


def test_saved_tensor_files_follow_the_umask(tmp_path):
    """safetensors creates files 0600; ours get what open() would give under the umask."""
    import stat

    from poetxq.training.checkpoint import write_tensors

    old = os.umask(0o022)
    try:
        write_tensors({"w": torch.ones(3)}, tmp_path / "a.safetensors")
        os.umask(0o077)
        write_tensors({"w": torch.ones(3)}, tmp_path / "b.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b.safetensors").stat().st_mode) == 0o600


def test_a_resume_that_trains_no_step_keeps_the_runs_tokens_per_s(saved_run, tmp_path, capsys):
    """A resume at the last step (only the evaluation and model file left) trained nothing: its
    summary keeps the earlier session's rate (the checkpoint carries steps and stepping
    seconds), not 0 tok/s, and the first session's CUDA peaks (none on a CPU)."""
    run = tmp_path / "r"
    shutil.copytree(saved_run, run)
    first = json.loads((run / "summary.json").read_text())
    (run / "model.safetensors").unlink()
    (run / "summary.json").unlink()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    again = json.loads((run / "summary.json").read_text())
    assert first["tokens_per_s"] > 0
    assert again["tokens_per_s"] == pytest.approx(first["tokens_per_s"], rel=0.02)
    for key in ("peak_memory_bytes", "peak_reserved_bytes"):
        if first[key] is None:  # a CPU run: no CUDA peaks to carry
            assert again[key] is None
        else:  # a GPU run's peaks are carried: the resume's are at least the first session's
            assert again[key] >= first[key]
    assert "since the resume" not in capsys.readouterr().out


def test_cuda_peaks_are_the_largest_over_sessions(monkeypatch):
    """Allocated and reserved peaks: each the max of this session's and the checkpoint's."""
    from types import SimpleNamespace

    from poetxq.training.train import _Run

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 7)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 9)
    cuda = torch.device("cuda")
    assert _Run._peaks(SimpleNamespace(device=cuda, peaks_before=(10, 5))) == (10, 9)
    assert _Run._peaks(SimpleNamespace(device=cuda, peaks_before=(None, None))) == (7, 9)
    cpu = SimpleNamespace(device=torch.device("cpu"), peaks_before=(10, 5))
    assert _Run._peaks(cpu) == (None, None)
