"""The eval scripts that turn committed results into pages, and the comparison's recipes."""

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    sys.path.insert(0, str(REPO / "evals"))
    spec = importlib.util.spec_from_file_location(name, REPO / "evals" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_results_page_reads_its_numbers_from_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    render = _load("render_results")
    out = tmp_path / "RESULTS.md"
    sbs = tmp_path / "side_by_side.md"
    readme = tmp_path / "README.md"
    readme.write_text((REPO / "README.md").read_text())
    args = ["--out", str(out), "--side-by-side-out", str(sbs), "--readme", str(readme)]
    assert render.main(args) == 0
    assert readme.read_text() == (REPO / "README.md").read_text()  # rendered from the same files
    page = out.read_text()
    assert sbs.read_text().startswith("# Side by side with the official")
    assert "\n".join(sbs.read_text().splitlines()[1:]) in page  # the same tables, on their own
    assert "[QUALITY.md](QUALITY.md)" in page
    memory = json.loads((REPO / "evals/results/gpu_memory_h200.json").read_text())
    for r in memory["results"]:
        assert f"| {r['peak_memory_gib']:.2f} | {r['estimated_peak_gib']:.2f} |" in page


def test_gpu_test_record_section_reads_counts_and_failures(tmp_path, monkeypatch):
    render = _load("render_results")
    files = importlib.import_module("results_files")
    monkeypatch.setattr(files, "RESULTS", tmp_path)
    monkeypatch.setattr(
        render, "current", lambda stem, machine="h200": f"{stem}_{machine}_abc.json"
    )
    doc = {"gpu": "NVIDIA H100", "commit": "abc1234", "date": "2026-12-06", "command": "pytest",
           "counts": {"passed": 10, "failed": 2, "skipped": 1}, "duration_s": 321.6,
           "timed_out": True,
           "failures": ["FAILED tests/a.py::t1 - x", "FAILED tests/b.py::t2"]}  # fmt: skip
    (tmp_path / "gpu_tests_h100_abc.json").write_text(json.dumps(doc))
    page = "\n".join(render.gpu_test_record())
    row = "| NVIDIA H100 | abc1234 | 10 | 2 | 1 | 322 (cut off by its timeout) | "
    assert row + "tests/a.py::t1 - x; tests/b.py::t2 |" in page
    assert "gpu_tests_h200" not in page  # no H200 record: no row
    # cut off before pytest's summary: no counts, only what the test log recorded
    failed = [{"test": "tests/c.py::t3", "when": "call"}]
    cut = {"gpu": "NVIDIA H200", "commit": "def5678", "date": "2026-12-06", "command": "pytest",
           "counts": {}, "duration_s": None, "wall_s": 370.2, "timed_out": True, "failures": [],
           "tests_run": 1398, "failed_tests": failed}  # fmt: skip
    (tmp_path / "gpu_tests_h200_abc.json").write_text(json.dumps(cut))
    page = "\n".join(render.gpu_test_record())
    row = "| NVIDIA H200 | def5678 | 1397 of 1398 run | 1 | – | 370 (cut off by its timeout) | "
    assert row + "tests/c.py::t3 |" in page
    monkeypatch.setattr(files, "RESULTS", tmp_path / "none")
    assert render.gpu_test_record() == []


def test_slab_gemm_table_reads_every_ratio_from_the_json():
    memory = _load("results_memory")
    name = "slab_decode_h200_8b1763c.json"
    doc = json.loads((REPO / "evals/results" / name).read_text())
    page = "\n".join(memory.slab_gemms(name))
    for r in doc["gemm"]:
        fwd = r["forward"]
        want = (
            f"| {r['M']} × {r['K']} × {r['N']} | forward | {fwd['bf16_matmul']['ms']:.3f} | "
            f"{fwd['int8 default 32MiB balanced']['ratio_vs_bf16']:.3f} | "
            f"{fwd['nf4 picked 32MiB balanced']['ratio_vs_bf16']:.3f} | "
            f"{fwd['bnb_matmul_4bit']['ratio_vs_bf16']:.3f} |"
        )
        assert want in page
    assert memory.slab_gemms("no_such_file.json") == []


def test_results_page_has_the_kernel_targets_of_one_run():
    memory = _load("results_memory")
    doc = json.loads((REPO / "evals/results" / memory.current("kernel_targets")).read_text())
    page = "\n".join(memory.kernel_targets_section())
    assert page.startswith("## Kernel targets in one run")
    assert f"commit {doc['commit']}" in page and "Top CUDA kernels" not in page
    cnp = doc["cnp"]["ms"]
    speedup = cnp["reference"]["fwd_bwd"] / cnp["fused_hybrid"]["fwd_bwd"]
    assert f"| {speedup:.3f} | >= 3.00 | **no** |" in page
    assert memory.kernel_targets_section("no_such_file.json") == []


def test_results_page_refuses_an_unwritable_out_before_drawing(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    render = _load("render_results")
    (tmp_path / "afile").write_text("x")
    for out, why in [(tmp_path, "is a directory"), (tmp_path / "afile" / "R.md", "is a file")]:
        with pytest.raises(SystemExit) as exc:
            render.main(["--out", str(out)])
        assert exc.value.code == 2 and why in capsys.readouterr().err.strip().splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no img/ made


def test_tokens_table_names_variants_and_graphs_in_rows_and_ratio_lines(tmp_path, monkeypatch):
    training, memory = _load("results_training"), _load("results_memory")
    monkeypatch.setattr(importlib.import_module("results_files"), "RESULTS", tmp_path)
    run = {"seq_len": 256, "tokens_per_s": 1000.0, "step_time_s": 8.192, "build_s": 1.0,
           "peak_memory_bytes": 2 << 30, "peak_reserved_bytes": 3 << 30}  # fmt: skip
    doc = {
        "date": "2026-12-01", "gpu": "cpu", "commit": "abc", "command": "x",
        "runs": [{**run, "method": "poetxq", "variant": "fast", "cuda_graph": True},
                 {**run, "method": "adamw", "variant": None},
                 {**run, "method": "poetx", "variant": "fast", "memory_plan": "balanced"}],
        "ratios": [{"seq_len": 256, "poetxq_over_qgalore": 1.5, "poetxq_over_adamw": 0.7,
                    "poetxq_fast_graph_over_qgalore": 2.0, "poetxq_fast_graph_over_adamw": 0.95,
                    "poetxq_graph_over_qgalore": 1.9, "poetxq_graph_over_adamw": 0.8}],
    }  # fmt: skip
    (tmp_path / "t.json").write_text(json.dumps(doc))
    page = "\n".join(training.tokens_table("t.json", "## t"))
    assert "| 256 | POET-XQ (int8 W0), fast, CUDA graph | 1,000 |" in page
    assert "| 256 | AdamW | 1,000 |" in page
    # a run auto fitted to its card with a smaller plan says so (not the recipe as written)
    assert "| 256 | POET-X (bf16 W0), fast, balanced plan | 1,000 |" in page
    assert (
        "POET-XQ / AdamW = 0.70 (target ≥ 0.9); POET-XQ in a CUDA graph: 1.90× Q-GaLore, "
        "0.80× AdamW; POET-XQ fast in a CUDA graph: 2.00× Q-GaLore, 0.95× AdamW"
    ) in page
    # the memory-options table: a graph row's peak is its reserved one, beside the warm-up peak
    row = {"model": "llama-8b", "gradient_checkpointing": True, "cuda_graph": True,
           "loss_chunk_tokens": 256, "peak_memory_bytes": 10 << 30,
           "peak_reserved_bytes": 12 << 30, "warmup_peak_bytes": 11 << 30,
           "estimated_peak_gib": 11.5, "target_peak_gib": 11, "step_time_s": 0.34,
           "speedup_vs_official": 2.6}  # fmt: skip
    (tmp_path / "m.json").write_text(json.dumps({**doc, "results": [row], "note": "n."}))
    page = "\n".join(memory.memory_options_table(["m.json", "absent.json"], "## m"))
    assert (
        "| 1 | llama-8b | yes | yes | 256 | no | no | 12.00 (reserved) | 11.00 | 11.50 | 11 "
        "| 0.340 | 2.60 |"
    ) in page
    assert "1. Source: `evals/results/m.json` (cpu, 2026-12-01, commit abc). n." in page


def test_bench_cnp_stacks_the_llama_8b_blocks_and_needs_a_gpu(capsys):
    bench = _load("bench_cnp")
    total, rows = bench.model_blocks("llama-8b:poetxq", 256)
    # 32 layers x (4 attention projections x (16 + 16) + gate/up 2 x (56 + 16) + down (16 + 56))
    assert total == 32 * (4 * 32 + 2 * 72 + 72) == 11008
    assert {r["name"]: (r["R_blocks"], r["P_blocks"]) for r in rows}["down_proj"] == (16, 56)
    if not __import__("torch").cuda.is_available():
        assert bench.main([]) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "needs a CUDA GPU" in err


def test_bench_gather_routes_agree_and_it_needs_a_gpu(capsys, tmp_path):
    """Every route of evals/bench_gather.py computes x[..., perm] (the transposed ones as
    [d, T]); the script itself refuses to run without CUDA, in one line."""
    import torch

    bench = _load("bench_gather")
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's routes: CPU only interpreted
    x = torch.randn(6, 10, dtype=torch.bfloat16, device=dev)
    perm = torch.randperm(10, device=dev)
    for name, fn in bench._routes(x, perm).items():
        got = fn()
        got = got.t() if got.shape != x.shape else got
        assert torch.equal(got, x[:, perm]), name
    if not torch.cuda.is_available():
        assert bench.main(["--out", str(tmp_path / "g.json")]) == 2
        assert capsys.readouterr().err.strip() == "bench_gather: error: needs a CUDA device"


def test_bench_int8_gemm_check_holds_on_cpu_and_it_needs_a_gpu(capsys):
    """The bench's real-size correctness check at a small size (the kernels under the Triton
    interpreter): the kernels equal the oracle and keep the derived bound; the dequant path's
    error is recorded beside them. Without CUDA the script refuses in one line."""
    pytest.importorskip("triton")
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    from quant_kernels.reference import quantize_int8_rowwise

    bench = _load("bench_int8_gemm")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    cb, scb = quantize_int8_rowwise(torch.randn(40, 72, generator=gen))
    x = torch.randn(50, 72, generator=gen).to(torch.bfloat16)
    g = torch.randn(50, 40, generator=gen).to(torch.bfloat16)
    res = bench.check_shape(cb.to(dev), scb.to(dev), x.to(dev), g.to(dev), 33)
    assert res["rows"] == 33 and res["quantizer_codes_equal"]
    for key in ("forward", "dx"):
        assert res[key]["int8_mma"]["within_bound_fraction"] == 1.0, res
        assert 0 < res[key]["int8_mma"]["max_err_over_bound"] <= 1
        assert res[key]["int8_mma"]["rel_err_vs_fp64"] < 0.02
        assert 0 < res[key]["int8_dequant"]["rel_err_vs_fp64"] < 0.02
        if dev == "cpu":
            assert res[key]["int8_mma_equal_to_oracle"]
    if not torch.cuda.is_available():
        assert bench.main([]) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "needs a CUDA GPU" in err


def test_int8_gemm_error_records_every_projection_and_restores_the_format():
    """evals/int8_gemm_error.py's measurement: every GEMM against an int8 W0 of one forward and
    backward, per projection type, at the activation-quantization level of error."""
    from poetxq.model.config import ModelConfig, POETConfig
    from poetxq.model.surgery import build_llama, convert_to_poetx
    from quant_kernels.formats import Int8Rowwise

    mod = _load("int8_gemm_error")
    before = Int8Rowwise.matmul_t
    torch.manual_seed(0)
    model = build_llama(ModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                    num_hidden_layers=2), 64)  # fmt: skip
    convert_to_poetx(model, POETConfig(block_size=8), generator=torch.Generator().manual_seed(1))
    res = mod.measure(model, torch.randint(0, 64, (2, 16)))
    assert Int8Rowwise.matmul_t is before
    kinds = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert sorted(res) == kinds
    for row in res.values():
        assert row["h"]["gemms"] == 4  # 2 layers x (forward + the mem recompute)
        assert row["dz_nearest"]["gemms"] == row["dz_stochastic"]["gemms"] == 2
        for q in ("h", "dz_nearest", "dz_stochastic"):
            assert 1e-4 < row[q]["mean"] <= row[q]["max"] < 0.05, row
    # stochastic rounding's larger variance shows in its error (on average over the types)
    mean = lambda q: sum(r[q]["mean"] for r in res.values()) / len(res)  # noqa: E731
    assert mean("dz_stochastic") > mean("dz_nearest")


@pytest.mark.parametrize("bits", [8, 4, 16])
def test_gpu_suite_layer_oracle_holds_on_cpu(bits):
    # the GPU run's correctness check, at a small size: every store layout must pass it (an
    # oracle that un-permuted the 4-bit store's columns once reported 1.41 for a correct layer)
    suite = _load("gpu_suite")
    gen = torch.Generator().manual_seed(0)
    res = suite.correctness(128, 192, 16, bits, gen, dev="cpu", tokens=64)
    assert res["fp32"]["y_rel_err"] < 1e-5 and res["fp32"]["dx_rel_err"] < 1e-5, res
    assert res["bf16_autocast"]["y_rel_err"] < 2e-2, res


def test_kernel_flags_make_a_policy_by_field_name_and_bad_specs_are_refused():
    """--kernel-flag NAME=0|1 builds the policy a benchmark passes to what it builds (no module
    state changes)."""
    from quant_kernels.policy import AUTO, KernelPolicy

    common = _load("_common")
    kernels = common.kernel_policy(["fused_cnp=0"])
    assert kernels == KernelPolicy(fused_cnp=False) and AUTO.fused_cnp
    assert kernels.to_dict()["fused_cnp"] is False and "feature_major" in kernels.to_dict()
    assert common.kernel_policy([]) == AUTO
    for bad in ("fused_cnp=yes", "NO_SUCH_FLAG=1", "FUSED_CNP_MEASURED_FASTER=0", "fused_cnp"):
        with pytest.raises(ValueError, match="NAME=0 or NAME=1"):
            common.kernel_policy([bad])


@pytest.mark.parametrize("script", ["throughput", "gpu_memory"])
@pytest.mark.parametrize("bad", [["--models", "llama-99b"], ["--set", "model.foo=1"],
                                 ["--device", "tpu"]])  # fmt: skip
def test_eval_scripts_refuse_bad_arguments_in_one_line_before_work(script, bad, tmp_path, capsys):
    mod = _load(script)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--out", str(tmp_path / "x.json"), *bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in err[-1] and "Traceback" not in "\n".join(err)  # argparse's one line
    assert not (tmp_path / "x.json").exists()


def test_throughput_ratios_for_eager_and_graphed_poetxq(tmp_path, capsys):
    mod = _load("throughput")
    tps = {"poetxq": 30.0, "poetxq_graph": 45.0, "qgalore": 20.0, "adamw": 50.0, "poetx": 1.0}
    assert mod.target_ratios(tps) == {
        "poetxq_over_qgalore": 1.5, "meets_qgalore_target": True,
        "poetxq_over_adamw": 0.6, "meets_adamw_target": False,
        "poetxq_graph_over_qgalore": 2.25, "poetxq_graph_over_adamw": 0.9,
    }  # fmt: skip
    assert mod.target_ratios({"poetxq": 1.0}) == {}
    fast = mod.target_ratios({"poetxq_fast_graph": 45.0, "adamw": 50.0, "qgalore": 15.0})
    assert fast == {"poetxq_fast_graph_over_adamw": 0.9, "poetxq_fast_graph_over_qgalore": 3.0}
    # AdamW in a CUDA graph too: every POET-XQ key also gets its ratio to that run
    both = mod.target_ratios({"poetxq_graph": 45.0, "adamw": 50.0, "adamw_graph": 60.0})
    assert both == {"poetxq_graph_over_adamw": 0.9, "poetxq_graph_over_adamw_graph": 0.75}
    assert mod.split_method("poetxq+fast") == ("poetxq", "fast", "poetxq_fast")
    training = _load("results_training")
    line = training.ratio_line({"seq_len": 256, **both})
    assert line == "- seq 256: in a CUDA graph / AdamW = 0.90, 0.75× AdamW in a CUDA graph"
    assert training.ratio_key_label("poetxq_fast_graph") == "fast in a CUDA graph"
    assert training.ratio_key_label("poetxq4_graph") == "4-bit in a CUDA graph"
    assert mod.split_method("adamw") == ("adamw", None, "adamw")
    with pytest.raises(ValueError, match="fast or mem"):
        mod.split_method("poetxq+quick")
    # refused before any run, in one line: a CUDA graph for a baseline, a CUDA graph on the CPU,
    # a profile folder that is a file
    (tmp_path / "afile").write_text("x")
    for flags, why in [
        (["--graph-methods", "qgalore"], "train.cuda_graph applies to the POET methods and adamw"),
        (["--graph-methods", "poetxq", "--device", "cpu"], "--graph-methods needs a CUDA device"),
        (["--profile-dir", str(tmp_path / "afile"), "--device", "cpu"], "is a file"),
        (["--methods", "adamw+fast", "--device", "cpu"], "only the POET methods have a variant"),
        (["--methods", "poetxq+", "--device", "cpu"], "fast or mem"),
        (["--out", str(tmp_path), "--device", "cpu"], "is a directory"),
        (["--out", str(tmp_path / "afile" / "x.json"), "--device", "cpu"], "is a file"),
    ]:
        with pytest.raises(SystemExit) as exc:
            mod.main(["--out", str(tmp_path / "x.json"), *flags])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert why in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "x.json").exists()


def test_cnp_rounding_emulates_the_hybrid_and_ranks_the_cheaper_factorizations():
    """The emulated default factorization is within bf16 rounding of float64; the cheaper ones
    (fewer passes) round measurably more, in forward and backward."""
    rounding = _load("cnp_rounding")
    errs = rounding.rounding_errors(64, 4, seed=0)
    fwd, bwd = errs["forward"], errs["backward"]
    assert 1e-4 < fwd["hybrid"] < 5e-3 and 1e-4 < bwd["hybrid"] < 5e-3
    assert fwd["A·Z"] > 1.3 * fwd["hybrid"] and fwd["A+A·S"] > fwd["hybrid"]
    assert bwd["A/Z"] > 1.3 * bwd["hybrid"]


@pytest.mark.slow
def test_host_profile_lists_the_bench_steps_host_time(tmp_path, capsys):
    mod = _load("host_profile")
    out = tmp_path / "host.txt"
    args = [str(REPO / "recipes/tiny/poetxq.yaml"), "--set", "model.num_hidden_layers=1",
            "--steps", "2", "--warmup", "0", "--rows", "100000", "--out", str(out)]  # fmt: skip
    assert mod.main(args) == 0
    text = out.read_text()
    assert text.startswith("bench tiny-poetxq (mem): ") and "2 steps of 8x1x128 tokens" in text
    # only the second step is profiled: its 7 POET projections, one backward each. Every function
    # is listed (--rows 100000): in the whole GPU suite a process's earlier tests add host work
    # (compiles, logging) that pushed this row out of a top-40 table.
    rows = [
        line
        for line in text.splitlines()
        if "poetxq/model/layout.py" in line and "(mem_backward)" in line
    ]
    assert rows, text[:3000]
    assert rows[0].split()[0] == "7"
    assert "cProfile by tottime" in text and "cProfile by cumtime" in text
    capsys.readouterr()
    bad = tmp_path / "bad.txt"
    assert mod.main(["llama-1b:poetxq", "--set", "model.foo=1", "--out", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("host_profile: ") and "\n" not in err and not bad.exists()


_FAKE_POET = """
import torch
from torch import nn


class POETLinear(nn.Module):
    def __init__(self, n, m, block_size=256, device=None, dtype=None, mem_efficient_mode=False):
        super().__init__()
        w = torch.zeros(m, n, device=device, dtype=dtype)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.oft_R = nn.Parameter(torch.zeros(n // block_size + m // block_size, 3))
        self.mem_efficient_mode = mem_efficient_mode


class QPOETLinear(POETLinear):
    @classmethod
    def from_linear(cls, linear, block_size=256, mem_efficient_mode=False):
        layer = cls(linear.in_features, linear.out_features, block_size,
                    mem_efficient_mode=mem_efficient_mode)
        layer.source = linear.weight.detach().clone()
        return layer
"""


@pytest.fixture
def fake_official(tmp_path, monkeypatch):
    """A stand-in ``poet_torch`` package in ``tmp_path`` (the real one is never in the repo)."""
    (tmp_path / "poet_torch").mkdir()
    (tmp_path / "poet_torch" / "__init__.py").write_text(_FAKE_POET)
    monkeypatch.delitem(sys.modules, "poet_torch", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    sys.modules.pop("poet_torch", None)


def test_official_code_is_found_only_where_asked_and_its_absence_is_one_line(tmp_path):
    op = _load("official_poet")
    with pytest.raises(op.OfficialNotFound, match=str(tmp_path)) as exc:
        op.load(tmp_path)
    assert "poet_torch/__init__.py" in str(exc.value) and "\n" not in str(exc.value)
    assert op.try_load(tmp_path) is None
    assert op.official_dir(None).name == ".official"  # git-ignored: never committed
    assert ".official/" in (REPO / ".gitignore").read_text().splitlines()


def test_official_layers_get_their_class_mem_mode_normalized_w0_and_nonzero_blocks(fake_official):
    op = _load("official_poet")
    poet = op.load(fake_official)
    assert Path(poet.__file__).parent.parent == fake_official
    for kind, (cls, mem) in op.LAYER_KINDS.items():
        layer = op.official_layer(poet, kind, 64, 128, 32, device="cpu", dtype=torch.float32)
        assert type(layer).__name__ == cls and layer.mem_efficient_mode is mem
        assert layer.oft_R.abs().sum() > 0  # R, P != I as in our layer benchmarks
        w = layer.weight if cls == "POETLinear" else layer.source
        if cls == "POETLinear":  # the official conversion normalizes rows (from_linear does it)
            torch.testing.assert_close(w.norm(dim=1), torch.ones(128))
        else:
            assert 0.015 < w.std().item() < 0.025  # the nn.Linear's N(0, 0.02) weight
    with pytest.raises(ValueError, match="xq_mem"):
        op.official_layer(poet, "xq_fast", 64, 128, 32, device="cpu")


def test_gpu_memory_refuses_official_without_the_copy_before_work(tmp_path, capsys):
    mod = _load("gpu_memory")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--out", str(tmp_path / "x.json"), "--official", str(tmp_path / "none")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--official: no official POET code in" in err[-1]
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--cuda-graph", "--settings", "ckpt", "--set", "train.optimizer_in_backward=true",
          "--set", "optim.grad_clip=0"], r"needs optim.state_bits: 8 .*drop --cuda-graph"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--offload", "--settings", "no_ckpt"], "--offload applies to the ckpt setting"),
        (["--set", "train.offload_activations=true"], "train.offload_activations: the script "
         "sets it per setting; use --offload"),
    ],
)  # fmt: skip
def test_gpu_memory_refuses_bad_combinations_in_one_line_before_work(
    tmp_path, capsys, extra, needle
):
    mod = _load("gpu_memory")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--out", str(tmp_path / "x.json"), "--models", "llama-8b", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.search(needle, err[-1]), err[-1]
    assert not (tmp_path / "x.json").exists()


def _gpu_memory_row(ckpt: bool, step: float, **extra) -> dict:
    return {"model": "llama-8b", "gradient_checkpointing": ckpt, "step_time_s": step,
            "peak_memory_bytes": 10 * 2**30, "peak_reserved_bytes": 12 * 2**30,
            "target_peak_gib": 11, **extra}  # fmt: skip


def test_side_by_side_tables_read_ours_and_the_official_rows_from_the_json(tmp_path, monkeypatch):
    sbs = _load("results_side_by_side")
    monkeypatch.setattr(importlib.import_module("results_files"), "RESULTS", tmp_path)
    head = {"gpu": "GPU X", "date": "2026-12-01", "commit": "abc1234"}

    def layer(ms: float, peak: float, base: float | None = None) -> dict:
        row = {"gpu_ms_graph": ms, "peak_extra_mib": peak}
        return row if base is None else {**row, "gpu_ratio": ms / base}

    shapes = [
        {"shape": "4096->14336", "nn_linear": layer(1.0, 168), "bits8_mem": layer(1.3, 300, 1.0),
         "official_xq_mem": layer(2.6, 363, 1.0)},
        {"shape": "14336->4096", "nn_linear": layer(2.0, 128), "bits8_mem": layer(2.5, 235, 2.0),
         "official_xq_mem": layer(4.0, 360, 2.0), "official_x_fast": {"error": "boom"}},
    ]  # fmt: skip
    (tmp_path / "official_layers_h200_abc.json").write_text(
        json.dumps({**head, "layer_overhead_8b_mlp_bf16": shapes})
    )
    off = {"step_time_s": 0.9, "peak_memory_gib": 12.98}
    eager = _gpu_memory_row(True, 0.6, official_measured=off)
    graph = _gpu_memory_row(True, 0.3, cuda_graph=True, loss_chunk_tokens=256)
    (tmp_path / "gpu_memory_8b_official_h200_abc.json").write_text(
        json.dumps({**head, "results": [eager]})
    )
    (tmp_path / "gpu_memory_8b_graph_h200_abc.json").write_text(
        json.dumps({**head, "results": [graph]})
    )
    page = "\n".join(sbs.side_by_side("abc"))
    assert "| ours: POET-XQ int8 `mem` | 1.300 / 2.500 | 1.30 / 1.25 | 300 / 235 |" in page
    assert "mem_efficient_mode) | 2.600 / 4.000 | 2.60 / 2.00 | 363 / 360 |" in page
    assert "ours is 2.00× / 1.60× faster than the official layer" in page
    assert "official: POET-X `fast`" not in page  # a row with an error is left out
    want = "| llama-8b | yes | eager | 10.00 | 0.600 | 12.98 | 0.900 | 1.50× | ≤ 11; ≥ 1.5× |"
    assert want in page
    # a file without its own official step is compared with the same setting's measured one
    assert "| CUDA graph, chunked loss | 12.00 (reserved) | 0.300 | 12.98 | 0.900 | 3.00× |" in page
    assert page.count("Source: `evals/results/") == 3
    assert sbs.side_by_side("nothing") == []


def test_gpu_memory_runs_the_official_step_in_the_row_setting(tmp_path, monkeypatch):
    mod = _load("gpu_memory")
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        out = Path(cmd[cmd.index("--out") + 1])
        out.write_text(json.dumps({"step_time_s": 0.9, "peak_memory_gib": 12.0}))
        return argparse.Namespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(mod.subprocess, "run", fake_run)
    args = argparse.Namespace(steps=3, device="cuda", official="", block_size=256, seq_len=2048)
    row = {"model": "llama-8b", "gradient_checkpointing": True, "batch_size": 4, "seq_len": 512,
           "block_size": 128, "step_time_s": 0.45, "meets_speed_target": False}  # fmt: skip
    mod.add_official(row, args)
    cmd = seen["cmd"]
    for flag, value in (("--batch-size", "4"), ("--seq-len", "512"), ("--block-size", "128"),
                        ("--model", "llama-8b")):  # fmt: skip
        assert cmd[cmd.index(flag) + 1] == value  # the row's setting, not the script's defaults
    assert "--ckpt" in cmd and "--official" not in cmd  # "" = the default copy
    assert row["speedup_vs_official_measured"] == pytest.approx(2.0)
    assert row["meets_speed_target"] is True  # judged on the measured step


def test_gpu_suite_runs_pytest_and_keeps_the_summary_and_failures(tmp_path):
    """The kernel_tests / training_tests parts: pytest's return code, summary line and FAILED
    lines, from a real pytest run over two small test files."""
    suite = _load("gpu_suite")
    (tmp_path / "test_a.py").write_text("def test_ok():\n    assert 1\n\n\n"
                                        "def test_bad():\n    assert 0\n")  # fmt: skip
    (tmp_path / "test_b.py").write_text("def test_ok2():\n    assert 1\n")
    log = tmp_path / "out.log"
    got = suite.run_pytest(tmp_path, ["test_a.py", "test_b.py"], log)
    assert got["returncode"] == 1
    assert got["failures"] == ["FAILED test_a.py::test_bad - assert 0"]
    assert "1 failed, 2 passed" in got["summary"][0]
    text = log.read_text()  # the whole output, as written during the run
    assert text.startswith("# ") and "test_a.py:6: in test_bad" in text
    repo = Path(suite.__file__).resolve().parents[1]
    assert all((repo / p).is_file() for p in suite.TRAINING_TEST_FILES)  # no stale name


def test_diagnostics_run_records_both_runs_and_the_merge_steps(tmp_path, monkeypatch, cpu_only):
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    diag = _load("diagnostics_run")
    out, png = tmp_path / "d.json", tmp_path / "d.png"
    sets = ["train.max_steps=6", "poet.merge_interval=4", "train.eval_every=0",
            "model.num_hidden_layers=1"]  # fmt: skip
    argv = ["--out", str(out), "--plot", str(png), "--every", "2"]
    assert diag.main(argv + [a for s in sets for a in ("--set", s)]) == 0
    doc = json.loads(out.read_text())
    assert doc["merge_steps"] == [4] and set(doc["runs"]) == {"bits 8", "bits 16"}
    for r in doc["runs"].values():
        assert [d["step"] for d in r["diag"]] == [0, 2, 4, 6] and r["merges"] == 1
        assert r["diag"][0]["diag_orth_error"] < 1e-12 < r["diag"][1]["diag_orth_error"]
    # int8 re-quantization at the merge moves the spectrum; an unquantized W0 barely does
    q8, q16 = (doc["runs"][k]["diag"][-1]["diag_sigma_drift_init"] for k in ("bits 8", "bits 16"))
    assert q8 > 10 * q16
    assert png.read_bytes().startswith(b"\x89PNG")
    # --from: the same records read back from a finished run directory (e.g. a GPU run's)
    trained = diag.run(8, 2, tmp_path / "w", [a for s in sets for a in ("--set", s)])
    again = tmp_path / "again.json"
    argv = ["--out", str(again), "--plot", str(png), "--from", f"int8={tmp_path / 'w' / 'bits8'}"]
    assert diag.main(argv) == 0
    back = json.loads(again.read_text())
    assert back["runs"]["int8"]["diag"] == trained["diag"] and back["every"] == 2
    assert back["merge_steps"] == [4] and back["gpu"] == "cpu fp32"  # summary.json's device
    with pytest.raises(SystemExit, match="is not a finished run directory"):
        diag.main(["--out", str(again), "--from", f"x={tmp_path}"])


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--no-relayout"]])
def test_memory_plans_script_records_what_bench_took_and_predicted(tmp_path, extra):
    """evals/memory_plans.py's smoke case on the CPU: one ``poetxq bench`` process with the lowest
    plan and 2 accumulated micro-batches; the record names the plan and the estimate. With
    ``--no-relayout`` the bench runs through the override program and says so."""
    mod = _load("memory_plans")
    out = tmp_path / "plans.json"
    argv = ["--device", "cpu", "--cases", "smoke", "--steps", "1", "--out", str(out), *extra]
    assert mod.main(argv) == 0
    case = json.loads(out.read_text())["cases"][0]
    assert case["relayout"] == (not extra)
    assert case["ok"] and case["plan"] == "lowest" and case["bench"]["offload_optimizer"]
    assert case["plan_line"].startswith("memory plan: lowest (train.memory)")
    assert case["predicted_peak_gib"] == case["bench"]["estimated_peak_bytes"] / 2**30 > 0


def test_memory_plans_judge_the_target_on_the_build_peak_too():
    mp = _load("memory_plans")
    gib = 2**30
    # the H100 record of 8b-lowest (a7b3d14): steps 9.26 GiB reserved, the build 10.26 GiB
    rec = {"peak_reserved_bytes": 9946791936, "build_peak_reserved_bytes": 11012145152}
    assert mp.verdicts(rec, 10.0) == {"meets_target": False, "build_within_step_peak": False}
    rec = {"peak_reserved_bytes": 9 * gib, "build_peak_reserved_bytes": 8 * gib}
    assert mp.verdicts(rec, 10.0) == {"meets_target": True, "build_within_step_peak": True}
    assert mp.verdicts(rec, None) == {"build_within_step_peak": True}
    assert mp.verdicts({"peak_reserved_bytes": None}, 10.0) == {}  # a CPU run
    # a merge's reserved peak over the target fails it too
    rec = {**rec, "merge_peak_reserved_bytes": 11 * gib}
    assert mp.verdicts(rec, 10.0) == {"meets_target": False, "build_within_step_peak": True}


def test_fpo_bench_places_the_targets_below_the_top_and_smoke_runs(tmp_path, capsys):
    bench = _load("fpo_bench")
    assert bench.target_layers(16, 4) == [12, 13, 14, 15]
    assert bench.target_layers(16, 4, below_top=8) == [4, 5, 6, 7]
    with pytest.raises(SystemExit, match="--targets 4 --below-top 13 do not fit in 16 layers"):
        bench.target_layers(16, 4, below_top=13)
    out = tmp_path / "b.json"
    argv = ["--tiny", "--device", "cpu", "--below-top", "2", "--bits", "16",
            "--methods", "fpo,sft-partial", "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["below_top"] == 2 and [r["method"] for r in doc["rows"]] == [
        "fpo", "sft-partial"]  # fmt: skip
    assert all(r["tokens_per_s"] > 0 and r["adapted_params"] == 3 * 64 * 128 for r in doc["rows"])
    # both full fine-tuning references, each row compared with each
    argv = ["--tiny", "--device", "cpu", "--bits", "16", "--methods", "fpo,full,full-ckpt",
            "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["fpo", "full", "full-ckpt"]
    assert rows[1]["speed_vs_full"] == 1.0 and rows[2]["speed_vs_full_ckpt"] == 1.0
    assert rows[0]["speed_vs_full"] == rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--device", "cpu", "--methods", "fpo,lora", "--out", str(out)])
    assert "--methods: unknown lora" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--device", "cpu", "--bits", "5", "--out", str(out)])
    assert "--bits '5': give a comma-separated list of 16, 8, 4" in capsys.readouterr().err
    # the references run at 16 bits only: said, not silently dropped
    argv = ["--tiny", "--device", "cpu", "--bits", "8", "--methods", "fpo, full", "--out", str(out)]
    assert bench.main(argv) == 0
    assert "note: full run at --bits 16 only" in capsys.readouterr().out
    assert [r["method"] for r in json.loads(out.read_text())["rows"]] == ["fpo"]


@pytest.mark.parametrize("below_top", [0, 1])
def test_fpo_bench_gemm_model_counts_what_torch_counts(below_top):
    """gemm_macs against torch's own count of the matrix products (FlopCounterMode: 2 flops per
    MAC) in one step of each method on a tiny Llama with eager attention (full S x S products)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    bench = _load("fpo_bench")
    d, f, layers, vocab, seq, batch, targets = 64, 96, 4, 256, 16, 2, 2
    want = bench.gemm_macs(d, f, layers, vocab, seq, targets, below_top, causal_skip=False)
    assert set(want) == set(bench.METHODS)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    where = bench.target_layers(layers, targets, below_top)
    for method in bench.METHODS:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=f,
                             num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=4, attn_implementation="eager")  # fmt: skip
        adapter = bench.make_adapter(LlamaForCausalLM(config), method, where)
        with FlopCounterMode(display=False) as counter:
            adapter.step(ids[:, :-1], ids[:, 1:])
        # the rotary angles' outer product (positions x inverse frequencies) is a matmul in some
        # transformers releases and a broadcast multiply in others; gemm_macs leaves it out
        rotary = sum(sum(c.values()) for m, c in counter.get_flop_counts().items()
                     if m.endswith("rotary_emb"))  # fmt: skip
        assert counter.get_total_flops() - rotary == 2 * want[method] * batch * seq, method
