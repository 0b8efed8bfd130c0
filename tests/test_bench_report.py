"""``poetxq bench`` (CPU, random tokens), whole-layer checkpointing, and ``poetxq report`` built
from two real tiny CPU runs of different methods."""

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from poetxq.model.surgery import build_llama, convert_to_poetx
from poetxq.tools.bench import dense_param_count, git_commit, run_bench
from poetxq.tools.cli import main
from poetxq.training.evaluate import causal_lm_loss
from poetxq.training.recipe_files import load_recipe

SMALL = {
    "model.hidden_size": 64, "model.intermediate_size": 136, "model.num_attention_heads": 4,
    "model.num_hidden_layers": 2, "poet.block_size": 16, "train.batch_size": 2,
    "train.seq_len": 16, "data.vocab_size": 300, "baseline.rank": 8,
}  # fmt: skip


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path_factory.getbasetemp() / "data-cache"))


def test_a_snapshots_commit_file_names_the_commit_not_the_checkout_around_it(tmp_path, monkeypatch):
    monkeypatch.delenv("POETXQ_COMMIT", raising=False)
    (tmp_path / ".commit").write_text("a7b3d14\n")  # evals/quality_snapshot.sh's file
    assert git_commit(tmp_path) == "a7b3d14"
    monkeypatch.setenv("POETXQ_COMMIT", "1234abc")
    assert git_commit(tmp_path) == "1234abc"
    monkeypatch.delenv("POETXQ_COMMIT")
    (tmp_path / ".commit").unlink()
    assert git_commit(tmp_path) is None  # neither a file nor a git checkout there


def test_dense_param_count_equals_transformers():
    r = load_recipe("llama-60m:poetxq")
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1280,
                      num_attention_heads=8, num_hidden_layers=8)  # fmt: skip
    with torch.device("meta"):
        ref = LlamaForCausalLM(cfg).num_parameters()
    assert dense_param_count(r, 32000) == ref


@pytest.mark.parametrize("method", ["poetxq", "qgalore"])
def test_bench_cpu_measures_tokens_and_mfu(method):
    r = load_recipe(None, {**SMALL, "method": method})
    res = run_bench(r, 2, warmup=1, peak_tflops=1.0, device="cpu", echo=lambda _s: None)
    assert res.tokens_per_step == 2 * 16 and res.steps == 2
    assert math.isclose(res.tokens_per_s * res.step_time_s, res.tokens_per_step, rel_tol=1e-9)
    assert math.isclose(res.mfu, 6 * dense_param_count(r, 300) * res.tokens_per_s / 1e12)
    assert res.peak_memory_bytes is None and res.peak_rss_bytes > 0
    assert res.run_label == f"tiny-{method}" and res.estimated_peak_bytes > 0
    assert res.variant == ("mem" if method in ("poetxq", "poetx") else None)
    graphed = dataclasses.replace(res, cuda_graph=True, peak_reserved_bytes=3 << 30)
    assert "peak memory 3.00 GiB reserved (CUDA graph)" in graphed.summary_line()
    # a CPU run's RSS is not set against the GPU estimate as if they measured the same thing
    est = res.estimated_peak_bytes / 2**30
    assert (
        f"peak RSS {res.peak_rss_bytes / 2**30:.2f} GiB (GPU tensors' estimate {est:.2f} GiB)"
        in (res.summary_line())
    )
    on_gpu = dataclasses.replace(res, peak_memory_bytes=2 << 30)
    assert f"peak memory 2.00 GiB (estimate {est:.2f} GiB)" in on_gpu.summary_line()
    # a POET run merges once after the timed steps (its peaks are CUDA's only); a baseline never
    if method == "poetxq":
        assert res.merge_s > 0 and res.merge_peak_memory_bytes is None
        assert res.summary_line().endswith(f"; a merge {res.merge_s:.2f} s")
        merged = dataclasses.replace(res, merge_peak_memory_bytes=5 << 30)
        assert merged.summary_line().endswith(f"; a merge {res.merge_s:.2f} s, peak 5.00 GiB")
    else:
        assert res.merge_s is None and "merge" not in res.summary_line()


def test_merge_once_merges_every_poet_layer_as_the_trainer_does():
    """bench's merge: R·W0·P kept (up to int8 re-quantization), Q reset to 0 with its moments."""
    from poetxq.model.layer import POETXLinear
    from poetxq.tools.bench import merge_once
    from poetxq.training.optim import build_optimizer

    r = load_recipe(None, {**SMALL, "method": "poetxq"})
    torch.manual_seed(0)
    model = build_llama(r.model, 300)
    convert_to_poetx(model, r.poet, generator=torch.Generator().manual_seed(1))
    layers = [m for m in model.modules() if isinstance(m, POETXLinear)]
    with torch.no_grad():
        for q in (p for m in layers for p in m.orthogonal_parameters()):
            q.normal_(0, 0.05)  # rotations away from the identity
    opt = build_optimizer(model, r.optim)
    before = [m.effective_weight(torch.float64) for m in layers]
    out = merge_once(model, opt, torch.device("cpu"), seed=0)
    assert out["merge_s"] > 0 and out["merge_peak_memory_bytes"] is None
    for m, w in zip(layers, before, strict=True):
        assert all(torch.count_nonzero(p) == 0 for p in m.orthogonal_parameters())
        rel = (m.effective_weight(torch.float64) - w).norm() / w.norm()
        assert 0 < rel < 0.02  # int8 re-quantization only, not a lost rotation


def test_bench_cli_writes_json_and_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")  # recorded, not used
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")  # torch's newer name
    out = tmp_path / "b.json"
    sets = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]
    args = ["--steps", "2", "--device", "cpu", "--gradient-checkpointing", "--out", str(out)]
    assert main(["bench", "--recipe", "recipes/tiny/poetxq.yaml", *sets, *args]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    line = printed[-1]
    assert sum(p.startswith("model: built in ") and p.endswith(" s on cpu") for p in printed) == 1
    assert not any(p.startswith("note: no CUDA device") for p in printed)  # --device cpu: asked
    data = json.loads(out.read_text())
    assert line.startswith("bench tiny-poetxq (mem): ") and "MFU n/a" in line and "peak RSS" in line
    assert data["variant"] == "mem"
    assert f"{data['tokens_per_s']:,.0f} tok/s" in line
    assert data["gradient_checkpointing"] is True and data["steps"] == 2
    assert data["alloc_conf"] == "max_split_size_mb:64,expandable_segments:False"
    assert data["precision"] == "fp32"
    assert main(["bench", "--recipe", "recipes/tiny/poetxq.yaml", "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps >= 1" in err[0]
    # no --device: CUDA when there is one, else the CPU, and then the run says so first
    assert main(["bench", "--recipe", "recipes/tiny/poetxq.yaml", *sets, "--steps", "1"]) == 0
    first = capsys.readouterr().out.strip().splitlines()[0]
    note = "note: no CUDA device: timing on the CPU (pass --device cpu to say so)"
    assert (first == note) == (not torch.cuda.is_available())


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--vocab-size", "-5"], "--vocab-size must be a positive integer, got -5"),
        (["--vocab-size", "0"], "--vocab-size must be a positive integer, got 0"),
        (["--peak-tflops", "inf"], "--peak-tflops must be a positive finite number"),
        (["--peak-tflops", "nan"], "--peak-tflops must be a positive finite number"),
        (["--peak-tflops", "-1"], "--peak-tflops must be a positive finite number"),
        (["--batch-size", "0"], "key 'train.batch_size': Input should be greater than 0"),
    ],
)
def test_bench_bad_sizes_are_one_line_before_any_work(capsys, flags, needle):
    args = ["bench", "--recipe", "recipes/tiny/poetxq.yaml", "--device", "cpu", *flags]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert "model: built" not in out  # refused before the model is built
    err_lines = err.strip().splitlines()
    assert len(err_lines) == 1 and needle in err_lines[0]


@pytest.mark.parametrize("variant", ["mem", "fast"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(variant):
    r = load_recipe(None, {**SMALL, "poet.variant": variant})
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = build_llama(r.model, 300)
        convert_to_poetx(model, r.poet, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():  # non-zero Q so the block gradients are not trivial
            for p in model.parameters():
                if p.dim() == 2 and p.shape[1] == 120:
                    p.normal_(0, 0.05)
        if ckpt:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model.train()
        batch = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(2))
        loss = causal_lm_loss(model, batch)
        loss.backward()
        grads.append(
            (loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
        )
    (l0, g0), (l1, g1) = grads
    assert l0 == pytest.approx(l1, rel=1e-6) and len(g0) == len(g1)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# A tiny but real run (as tests/test_cli.py): pydoc text, BPE trained on the train split.
TINY = [
    "--data", "pydoc", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "8",
    "--set", "poet.block_size=16", "--eval-every", "2", "--max-steps", "4", "--no-progress",
    "--set", "model.hidden_size=64", "--set", "model.intermediate_size=136",
    "--set", "model.num_attention_heads=4", "--set", "model.num_hidden_layers=2",
    "--set", "train.log_every=1", "--set", "optim.warmup_steps=1", "--set", "baseline.rank=8",
    "--set", "train.save_checkpoint=false",
]  # fmt: skip


@pytest.mark.slow
def test_report_from_two_tiny_cpu_runs(tmp_path, capsys, cpu_only):
    runs = tmp_path / "runs"
    for method in ("poetxq", "adamw"):
        assert main(["train", *TINY, "--method", method, "--output-dir", str(runs)]) == 0
    dirs = sorted(runs.iterdir())
    names = [d.name for d in dirs]
    assert re.fullmatch(r"tiny-adamw-\d{8}-\d{6}", names[0]), names
    assert re.fullmatch(r"tiny-poetxq-\d{8}-\d{6}", names[1]), names
    summaries = {d.name: json.loads((d / "summary.json").read_text()) for d in dirs}
    for s in summaries.values():
        assert s["peak_rss_bytes"] > 0 and s["peak_memory_bytes"] is None
        assert s["method"] in ("poetxq", "adamw")
    out = tmp_path / "report"
    # the first run given twice (once through a different spelling of its path) is one row
    again = str(dirs[0].parent / "." / dirs[0].name)
    capsys.readouterr()
    assert main(["report", *map(str, dirs), again, "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith("report.md (2 runs)")  # not 3
    md = (out / "report.md").read_text()
    assert md.count("2 runs; runs of the same model (recipe name and shape) are side by side") == 1
    assert f"Given more than once and reported once: `{again}`." in md
    rows = [line for line in md.splitlines() if line.startswith("| tiny-")]
    assert len(rows) == 2 and md.count("## tiny\n") == 1  # one table: side by side
    assert rows[0].startswith(f"| {names[1]} | poetxq | int8 W0 |")  # poetxq first
    for name, s in summaries.items():
        row = next(r for r in rows if r.startswith(f"| {name} "))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3] == f"{s['final_val_ppl']:.2f}"
        assert cells[4] == f"{s['tokens_per_s']:,.0f}"
        assert cells[5] == f"{s['peak_rss_bytes'] / 2**30:.2f} GiB (RSS)"
        assert cells[6] == f"{s['tokens']:,}" == f"{4 * 8 * 32:,}"
    for png in ("loss.png", "val_ppl.png", "throughput.png", "peak_memory.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert f"]({png})" in md
    # a run stopped by a signal before its final evaluation: n/a, not a traceback
    stopped = dirs[0] / "summary.json"
    s = json.loads(stopped.read_text())
    s.update(final_val_ppl=None, final_train_loss=None, interrupted=True, stop_signal="SIGTERM")
    stopped.write_text(json.dumps(s))
    assert main(["report", *map(str, dirs), "-o", str(out)]) == 0
    md = (out / "report.md").read_text()
    row = next(r for r in md.splitlines() if r.startswith(f"| {names[0]} — stopped by SIGTERM "))
    # no final evaluation: n/a, and the last one metrics.jsonl holds (after step 0)
    logged = [json.loads(ln) for ln in (dirs[0] / "metrics.jsonl").read_text().splitlines()]
    step, last = [(r["step"], r["val_ppl"]) for r in logged if r.get("step") and "val_ppl" in r][-1]
    assert [c.strip() for c in row.strip("|").split("|")][
        3
    ] == f"n/a (last {last:.2f} at step {step})"
    assert f"-> n/a (last {last:.2f} at step {step}) (stopped by SIGTERM)" in md


def test_report_bad_run_dir_is_one_line_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "recipe.yaml").write_text("name: x\n")
    out = tmp_path / "rep"
    assert main(["report", str(tmp_path / "half"), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "summary.json" in err[0]
    assert not out.exists()


def test_report_into_a_run_directory_is_refused(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "recipe.yaml").write_text("name: x\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "lr": 0.001}\n')
    before = sorted(p.name for p in run.iterdir())
    assert main(["report", str(run), "-o", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a run directory; write the report elsewhere" in err[0]
    assert sorted(p.name for p in run.iterdir()) == before


def test_report_into_a_read_only_place_is_one_line(tmp_path, capsys, monkeypatch):
    import poetxq.paths

    run = tmp_path / "r"
    run.mkdir()
    (run / "recipe.yaml").write_text("name: x\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "lr": 0.001}\n')
    real = poetxq.paths.os.access
    ro = str(tmp_path.absolute())
    monkeypatch.setattr(poetxq.paths.os, "access", lambda p, m: str(p) != ro and real(p, m))
    assert main(["report", str(run), "-o", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "read-only or not writable by this user; choose another -o" in err[0]
    assert not (tmp_path / "rep").exists()
    (tmp_path / "file").write_text("x")  # a file where a folder of -o would go
    assert main(["report", str(run), "-o", str(tmp_path / "file" / "rep")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"poetxq: error: cannot write '{tmp_path / 'file' / 'rep'}': "
        f"'{tmp_path / 'file'}' is a file, not a directory; choose another -o"
    ]


def test_report_without_o_writes_report_in_the_current_directory(tmp_path, capsys, monkeypatch):
    """-o is optional: the default is report/ in the current directory (--help says so); there
    the same refusals hold, in one line, with nothing written."""
    from poetxq.training.recipe import dump_recipe

    run = tmp_path / "tiny-poetxq-r"
    run.mkdir()
    (run / "recipe.yaml").write_text(dump_recipe(load_recipe(None, SMALL)))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "lr": 0.001}\n')
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    with pytest.raises(SystemExit) as exc:
        main(["report", "--help"])
    assert exc.value.code == 0
    helptext = " ".join(capsys.readouterr().out.split())
    assert "(default: report/ in the current directory)" in helptext
    (here / "report").write_text("mine")  # a file where the default folder would go: refused
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["poetxq: error: 'report' exists and is not a directory; choose another -o"]
    assert (here / "report").read_text() == "mine"
    (here / "report").unlink()
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == "report: report/report.md (1 run)"
    assert f"| {run.name} — interrupted" in (here / "report" / "report.md").read_text()
    assert (here / "report" / "loss.png").is_file()
    (here / "report" / "recipe.yaml").write_text("name: x\n")  # report/ is now a run directory
    before = sorted(p.name for p in (here / "report").iterdir())
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'report' is a run directory; write the report elsewhere" in err[0]
    assert sorted(p.name for p in (here / "report").iterdir()) == before
    # inside a run directory (cd into the run, default -o), or an empty -o: refused
    monkeypatch.chdir(run)
    assert main(["report", "."]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"poetxq: error: 'report' lies inside the run directory '{run}'; write the "
                   "report elsewhere (-o DIR)"]  # fmt: skip
    assert not (run / "report").exists()
    assert main(["report", ".", "-o", ""]) == 2
    assert "-o is empty; name a folder" in capsys.readouterr().err


def test_report_of_a_folder_of_runs_points_to_the_runs_inside(tmp_path, capsys):
    runs = tmp_path / "runs"
    (runs / "a").mkdir(parents=True)
    (runs / "a" / "recipe.yaml").write_text("name: x\n")
    assert main(["report", str(runs), "-o", str(tmp_path / "rep")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"poetxq: error: run directory '{runs}' has no recipe.yaml (not a poetxq run (it holds "
        f"runs: pass {runs}/*)); pass run directories made by poetxq train"]  # fmt: skip
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "-o", str(tmp_path / "rep")]) == 2
    assert "(not a poetxq run); pass" in capsys.readouterr().err  # no run inside: no hint
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize(
    "text,why",
    [("[1, 2]", "holds a JSON list"), ("{oops", "bad JSON"),
     ('{"steps": "x", "tokens_per_s": 1.0}', "'steps' is 'x', not a number"),
     ('{"steps": 3, "final_val_ppl": true}', "'final_val_ppl' is True, not a number")],
)  # fmt: skip
def test_report_bad_summary_is_one_line_naming_the_file(tmp_path, capsys, text, why):
    run = tmp_path / "r"
    run.mkdir()
    (run / "recipe.yaml").write_text("name: x\n")
    (run / "summary.json").write_text(text)
    out = tmp_path / "rep"
    assert main(["report", str(run), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "summary.json" in err[0] and why in err[0]
    assert not out.exists()


def test_report_bad_metrics_record_is_one_line(tmp_path, capsys):
    from poetxq.training.recipe import dump_recipe

    run = tmp_path / "r"
    run.mkdir()
    (run / "recipe.yaml").write_text(dump_recipe(load_recipe(None, SMALL)))
    lines = ['{"step": 0, "val_ppl": 400.0}', '{"step": "2", "loss": 5.0}']
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "rep"
    assert main(["report", str(run), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl record 2: 'step' is '2', not a number" in err[0]
    assert not out.exists()


def test_report_reads_an_interrupted_run_from_metrics_and_refuses_an_empty_one(tmp_path, capsys):
    from poetxq.training.recipe import dump_recipe

    run = tmp_path / "tiny-poetxq-killed"
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    (run / "recipe.yaml").write_text(dump_recipe(load_recipe(None, SMALL)))
    records = [
        {"step": 0, "val_loss": 6.0, "val_ppl": 403.4, "unigram_val_ppl": 200.0},
        {"step": 2, "loss": 5.5, "lr": 1e-3, "tokens": 64, "tokens_per_s": 100.0},
        {"step": 4, "loss": 5.0, "lr": 1e-3, "tokens": 128, "tokens_per_s": 300.0},
    ]
    lines = [json.dumps(r) for r in records] + ['{"step": 5, "lo']  # torn by the kill
    (run / "metrics.jsonl").write_text("\n".join(lines))
    out = tmp_path / "rep"
    assert main(["report", str(run), "-o", str(out)]) == 0
    md = (out / "report.md").read_text()
    row = next(r for r in md.splitlines() if r.startswith(f"| {run.name} "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == f"{run.name} — interrupted (no summary.json)"
    # ppl, tok/s, memory, tokens, wall time, precision (no device recorded: the setting),
    # memory options
    assert cells[3:] == ["n/a", "200", "n/a", "128", "n/a", "auto", "-"]
    assert "4 steps on n/a, n/a merges, val ppl 403.40 -> n/a (interrupted (no summary.json)" in md
    # neither summary.json nor metrics.jsonl: refused, nothing written
    (run / "metrics.jsonl").unlink()
    assert main(["report", str(run), "-o", str(tmp_path / "rep2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"poetxq: error: run directory '{run}' has neither summary.json nor metrics.jsonl (it "
        "never logged a step); pass run directories that trained"
    )
    assert not (tmp_path / "rep2").exists()


def test_bench_on_the_cpu_with_gpu_mem_says_the_plan_it_took(capsys):
    """--gpu-mem plans for a GPU the host lacks: bench says which plan that gave, as train does,
    rather than taking the flag without a word."""
    args = ["bench", "--recipe", "recipes/tiny/poetxq.yaml", "--device", "cpu", "--steps", "1"]
    assert main([*args, "--gpu-mem", "16GB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    plan = [ln for ln in lines if ln.startswith("memory plan:")]
    assert len(plan) == 1 and plan[0].startswith("memory plan: fastest (auto), predicted peak ")
    assert plan[0].endswith(" GiB of 16.0 GiB (--gpu-mem)")
    assert main(args) == 0  # no --gpu-mem on a CPU: auto is the recipe as written, no line
    assert not any(ln.startswith("memory plan:") for ln in capsys.readouterr().out.splitlines())


def test_bench_out_under_a_file_is_refused_before_the_benchmark(tmp_path, capsys):
    blocker = tmp_path / "results"
    blocker.write_text("a file, not a folder")
    args = ["bench", "--recipe", "recipes/tiny/poetxq.yaml", "--device", "cpu", "--steps", "1"]
    assert main([*args, "--out", str(blocker / "sub" / "b.json")]) == 2
    out, err = capsys.readouterr()
    assert "model: built" not in out and "bench " not in out  # nothing ran
    assert err.strip().splitlines() == [
        f"poetxq: error: --out '{blocker}/sub/b.json' cannot be written: '{blocker}' is a file, "
        "not a directory; choose another path"
    ]
    assert main([*args, "--out", str(tmp_path)]) == 2
    assert "is a directory; pass a file path" in capsys.readouterr().err
    # estimate-memory --json: the same check
    assert main(["estimate-memory", "--recipe", "llama-60m:poetxq", "--json",
                 str(blocker / "e.json")]) == 2  # fmt: skip
    out, err = capsys.readouterr()
    assert out == "" and f"--json '{blocker}/e.json' cannot be written" in err
    # a name longer than the filesystem takes (with the temporary file's room): refused early
    for long in (tmp_path / ("x" * 300 + ".json"), tmp_path / ("d" * 300) / "e.json",
                 tmp_path / ("y" * 240 + ".json")):  # fmt: skip
        assert main(["estimate-memory", "--recipe", "llama-60m:poetxq", "--json", str(long)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1
        assert "bytes, over the" in err and "choose a shorter name" in err
    ok = tmp_path / ("z" * 200 + ".json")
    assert main(["estimate-memory", "--recipe", "llama-60m:poetxq", "--json", str(ok)]) == 0
    assert ok.is_file()


def test_a_write_that_fails_late_names_the_file_asked_for(tmp_path, capsys, monkeypatch):
    """A folder that passes the early check but refuses the write (e.g. /proc for root) gets
    one line naming the requested file, not the temporary one."""
    from pathlib import Path

    real = Path.write_text

    def refuse(self, *a, **k):
        if ".tmp-" in self.name:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", refuse)
    target = tmp_path / "e.json"
    assert main(["estimate-memory", "--recipe", "llama-60m:poetxq", "--json", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"poetxq: error: cannot write '{target}' (No such file or directory); choose another path"
    ]
    assert list(tmp_path.iterdir()) == []


def test_report_names_memory_options_and_8bit_states():
    from types import SimpleNamespace

    from poetxq.tools.report import _memory_options
    from poetxq.training.recipe_files import load_recipe

    plain = SimpleNamespace(recipe=load_recipe(None))
    assert _memory_options(plain) == "-"
    over = {"optim.state_bits": 8, "train.gradient_checkpointing": True}
    lean = SimpleNamespace(recipe=load_recipe(None, {**over, "train.loss_chunk_tokens": 256}))
    assert _memory_options(lean) == "checkpointing, chunked loss (256), 8-bit states"


def test_bar_labels_tell_runs_of_one_recipe_and_method_apart(tmp_path):
    from poetxq.tools.report import bar_labels
    from poetxq.tools.run_dir import Run
    from poetxq.training.recipe_files import load_recipe

    def run(name: str, method: str = "poetxq") -> Run:
        return Run(tmp_path / name, load_recipe(None, {"method": method}), {})

    a, b, c = run("seed0"), run("seed1"), run("base", "adamw")
    assert bar_labels([a, c]) == ["tiny\npoetxq", "tiny\nadamw"]
    assert bar_labels([a, b, c]) == ["tiny\npoetxq\nseed0", "tiny\npoetxq\nseed1",
                                     "tiny\nadamw\nbase"]  # fmt: skip


def test_runs_of_one_recipe_name_but_other_shapes_get_their_own_tables(tmp_path):
    """``--set model.*`` changes the model and keeps the recipe name: such runs are not put
    side by side as one model; runs of one shape keep the plain name."""
    from poetxq.tools.report import results_rows
    from poetxq.tools.run_dir import Run, mark_shapes
    from poetxq.training.recipe_files import load_recipe

    def run(name: str, **model: int) -> Run:
        over = {f"model.{k}": v for k, v in model.items()}
        return Run(tmp_path / name, load_recipe(None, over), {"tokens_per_s": 1.0})

    small, big = run("small", hidden_size=64, intermediate_size=136), run("big")
    same = run("same")
    mark_shapes([big, same])
    assert (big.model, same.model) == ("tiny", "tiny")
    mark_shapes([small, big, same])
    assert small.model == "tiny (d 64, 4 layers, MLP 136, 4 heads)"
    assert big.model == same.model == "tiny (d 256, 4 layers, MLP 704, 4 heads)"
    assert [r["model"] for r in results_rows([small, big])] == [big.model, small.model]


def test_report_names_a_diverged_run_and_the_frozen_orthogonal_control(tmp_path):
    """A run that stopped on a NaN loss (train logs a ``diverged`` event and writes no summary)
    is "diverged at step N", not "interrupted"; a POET run with ``poet.freeze_orthogonal`` is
    labelled as the R = P = I control, not as POET-XQ."""
    from poetxq.training.recipe import dump_recipe

    nan = tmp_path / "tiny-poetxq-nan"
    nan.mkdir()
    (nan / "recipe.yaml").write_text(dump_recipe(load_recipe(None, SMALL)))
    records = [{"step": 0, "val_loss": 6.0, "val_ppl": 403.4},
               {"step": 2, "loss": 5.5, "tokens": 64, "tokens_per_s": 100.0},
               {"step": 3, "event": "diverged", "loss": None}]  # fmt: skip
    (nan / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    control = tmp_path / "tiny-poetxq-control"
    control.mkdir()
    frozen = load_recipe(None, {**SMALL, "poet.freeze_orthogonal": True})
    (control / "recipe.yaml").write_text(dump_recipe(frozen))
    (control / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_ppl": 403.4}) + "\n")
    summary = {"steps": 4, "final_val_ppl": 175.0, "tokens_per_s": 10.0, "method": "poetxq"}
    (control / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "rep"
    out.mkdir()
    (out / "peak_memory.png").write_bytes(b"an older report's chart")
    assert main(["report", str(nan), str(control), "-o", str(out)]) == 0
    md = (out / "report.md").read_text()
    # neither run recorded a peak: no empty chart, and the older one is gone with its link
    assert "(throughput.png)" in md and (out / "throughput.png").is_file()
    assert "peak_memory.png" not in md and not (out / "peak_memory.png").exists()
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")]
            for r in md.splitlines() if r.startswith("| tiny-")}  # fmt: skip
    assert rows[f"{nan.name} — diverged at step 3"][1] == "poetxq"
    assert rows[control.name][1:4] == ["poetxq, R = P = I control", "int8 W0", "175.00"]
    assert "val ppl 403.40 -> n/a (diverged at step 3; read from metrics.jsonl)" in md
    assert "interrupted" not in md


def test_report_shows_the_memory_plan_and_precision_where_runs_record_them(tmp_path):
    """summary.json's memory_plan and recipe.yaml's train.precision become two columns; a run
    directory from before either (its recipe.yaml without those keys, no memory_plan) still
    renders: '-' beside the others, and no such columns when no run has them."""
    import yaml

    from poetxq.training.memory import resolve_memory_plan
    from poetxq.training.recipe import dump_recipe

    def write(name: str, recipe_yaml: str, summary: dict) -> str:
        run = tmp_path / name
        run.mkdir()
        (run / "recipe.yaml").write_text(recipe_yaml)
        (run / "summary.json").write_text(json.dumps({"steps": 2, "tokens_per_s": 9.0, **summary}))
        return str(run)

    recipe, choice = resolve_memory_plan(
        load_recipe(None, SMALL), "cpu", gpu_mem=2**34, vocab_size=96
    )  # auto on a CPU: fastest; precision auto
    new = write("tiny-poetxq-new", dump_recipe(recipe),
                {"memory_plan": choice.to_dict(), "device": "cuda:0"})  # fmt: skip
    low = load_recipe(None, {**SMALL, "train.memory": "lowest"})
    low, named = resolve_memory_plan(low, "cpu")
    lowest = write("tiny-poetxq-low", dump_recipe(low),
                   {"memory_plan": named.to_dict(), "device": "cpu"})  # fmt: skip
    tree = yaml.safe_load(dump_recipe(load_recipe(None, SMALL)))
    del tree["train"]["precision"], tree["train"]["memory"]  # as poetxq wrote it before both
    old = write("tiny-poetxq-old", yaml.safe_dump(tree), {"device": "cpu"})
    killed = tmp_path / "tiny-poetxq-killed"  # no summary.json: the plan from recipe.yaml
    killed.mkdir()
    (killed / "recipe.yaml").write_text(dump_recipe(low))
    (killed / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")

    def table(*runs: str) -> dict[str, dict[str, str]]:
        out = tmp_path / f"rep{len(list(tmp_path.iterdir()))}"
        assert main(["report", *runs, "-o", str(out)]) == 0
        lines = [ln for ln in (out / "report.md").read_text().splitlines() if ln.startswith("|")]
        head = [c.strip() for c in lines[0].strip("|").split("|")]
        return {
            cells[0]: dict(zip(head, cells, strict=True))
            for cells in ([c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:])
        }

    rows = table(new, lowest, old, str(killed))
    assert rows["tiny-poetxq-killed — interrupted (no summary.json)"]["memory plan"] == "lowest"
    assert (rows["tiny-poetxq-new"]["memory plan"], rows["tiny-poetxq-new"]["precision"]) == (
        "fastest (auto)", "autocast (auto)")  # fmt: skip
    assert (rows["tiny-poetxq-low"]["memory plan"], rows["tiny-poetxq-low"]["precision"]) == (
        "lowest", "bf16-true")  # fmt: skip
    assert (rows["tiny-poetxq-old"]["memory plan"], rows["tiny-poetxq-old"]["precision"]) == (
        "-", "-")  # fmt: skip
    assert list(rows["tiny-poetxq-low"])[-3:] == ["precision", "memory plan", "memory options"]
    only_old = table(old)["tiny-poetxq-old"]
    assert "memory plan" not in only_old and "precision" not in only_old
    assert only_old["memory options"] == "-"


def test_a_resumed_run_says_where_it_resumed_in_the_table(tmp_path):
    """The row says where a run was resumed (its numbers cover every session)."""
    from poetxq.tools.report import results_rows
    from poetxq.tools.run_dir import Run
    from poetxq.training.recipe_files import load_recipe

    recipe = load_recipe(None)
    fresh = Run(tmp_path / "fresh", recipe, {"tokens_per_s": 10.0, "resumed_from": []})
    resumed = Run(tmp_path / "again", recipe, {"tokens_per_s": 9.0, "resumed_from": [10, 30]})
    rows = {r["run"] for r in results_rows([fresh, resumed])}
    assert rows == {"fresh", "again (resumed at step 10, 30)"}


def test_the_report_names_the_settings_that_differ_and_warns_on_other_data(tmp_path):
    """Runs side by side: a generic setting with more than one value is listed with its runs;
    a different sequence length (or data, vocabulary) is flagged as not comparable; runs that
    match say nothing."""
    from poetxq.tools.report import setting_differences
    from poetxq.tools.run_dir import Run
    from poetxq.training.recipe_files import load_recipe

    tiny = Path(__file__).resolve().parents[1] / "recipes" / "tiny"

    def run(name: str, recipe: str, **over) -> Run:
        return Run(
            tmp_path / name, load_recipe(tiny / recipe.removeprefix("recipes/tiny/"), over), {}
        )

    a = run("a", "recipes/tiny/poetxq.yaml")
    b = run("b", "recipes/tiny/qgalore.yaml", **{"optim.warmup_steps": 20})
    c = run("c", "recipes/tiny/poetxq.yaml", **{"train.seq_len": 64})
    assert setting_differences([a, run("a2", "recipes/tiny/poetxq.yaml")]) == []
    same_data = setting_differences([a, b])
    assert len(same_data) == 1 and same_data[0].startswith("Settings that differ: ")
    assert "`optim.lr` 0.005 (a), 0.015 (b)" in same_data[0]
    assert "`optim.betas` [0.9, 0.999] (a), [0.9, 0.95] (b)" in same_data[0]
    assert "warmup" not in same_data[0]  # equal here
    warn, rest = setting_differences([a, c])
    assert warn.startswith("**Not comparable:**") and "`train.seq_len` 128 (a), 64 (c)" in warn
    assert rest == "Settings that differ: `tokens per step` 1,024 (a), 512 (c)."


def test_json_through_a_link_or_into_a_pipe_keeps_the_link_and_the_pipe(tmp_path):
    """estimate-memory --json (bench --out, --profile) renames a temporary file over a regular
    file only: a symbolic link keeps pointing at its (rewritten) target, and a named pipe (as
    /dev/null or /dev/stdout would) is written to, not replaced by a file."""
    import json as _json
    import os
    import stat
    import threading

    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    assert main(["estimate-memory", "--recipe", "llama-60m:poetxq", "--json", str(link)]) == 0
    assert link.is_symlink() and _json.loads(target.read_text())["recipe"] == "llama-60m"
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    assert main(["estimate-memory", "--recipe", "llama-60m:poetxq", "--json", str(fifo)]) == 0
    reader.join(timeout=30)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # still a pipe
    assert _json.loads(got[0])["recipe"] == "llama-60m"
