"""GPU-time breakdown of a profiled step (poetxq.tools.profiling) and ``poetxq bench --profile``."""

from types import SimpleNamespace

import pytest
import torch

from poetxq.tools.cli import main
from poetxq.tools.profiling import format_breakdown, gpu_time_breakdown, kernel_category

CUDA = torch.autograd.DeviceType.CUDA
CPU = torch.autograd.DeviceType.CPU
COMPILED = "compiled elementwise (torch.compile)"
ATEN = "aten elementwise / copy / reduce"


def _row(name: str, us: float, device=CUDA):
    return SimpleNamespace(key=name, device_type=device, self_device_time_total=us)


@pytest.mark.parametrize(
    "name,category",
    [
        ("_skew_pairs_kernel", "cayley-neumann (triton)"),
        ("_cnp_bwd_e_kernel", "cayley-neumann (triton)"),
        ("_int8_slab_kernel", "weight decode (triton)"),
        ("_4bit_pair_slab_kernel", "weight decode (triton)"),
        ("_int8_mm_nt_kernel", "fused dequant-matmul (triton)"),
        ("_to_feature_major_kernel", "permute / block-diag (triton)"),
        ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", COMPILED),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "cuBLAS GEMM"),
        ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128", "cuBLAS GEMM"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
        ("void kOptimizer32bit2State<__nv_bfloat16, 2, 1024>", "optimizer and gradient clipping"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>", ATEN),
        ("void at::native::_scatter_gather_elementwise_kernel<128, 8>", ATEN),
        ("Memcpy DtoD (Device -> Device)", "memcpy / memset"),
        ("some_custom_kernel", "other"),
    ],
)  # fmt: skip
def test_kernel_names_fall_into_their_category(name, category):
    assert kernel_category(name) == category


def test_breakdown_sums_kernel_rows_per_step_and_splits_gemm_operators():
    rows = [
        _row("nvjet_sm90_tst_a", 3000.0),  # 3 ms of cuBLAS
        _row("nvjet_sm90_tst_b", 1000.0),
        _row("_int8_slab_kernel", 800.0),
        _row("_q2_aux_kernel", 200.0),
        _row("mystery", 400.0),
        _row("aten::mm", 2500.0, CPU),  # operator rows: only the GEMM split reads them
        _row("aten::addmm", 500.0, CPU),
        _row("aten::bmm", 1000.0, CPU),
        _row("aten::add", 9999.0, CPU),
        _row("_POETXMemFnBackward", 9999.0, CPU),
        _row("nvjet_zero", 0.0),
        _row("Optimizer.step#AdamW.step", 5000.0),  # a range over kernels counted already
    ]
    out = gpu_time_breakdown(rows, steps=2)
    assert out == {
        "cuBLAS GEMM": 2.0,
        "weight decode (triton)": 0.4,
        "other": 0.2,
        "cayley-neumann (triton)": 0.1,
        "total": 2.7,
        "of which mm (weight GEMMs)": 1.5,
        "of which bmm (block multiplies, CNP products)": 0.5,
    }
    assert list(out)[:4] == ["cuBLAS GEMM", "weight decode (triton)", "other",
                             "cayley-neumann (triton)"]  # fmt: skip
    text = format_breakdown(out)
    assert "cuBLAS GEMM" in text and " 74.1%" in text and "2.70" in text
    with pytest.raises(ValueError, match="steps must be >= 1"):
        gpu_time_breakdown(rows, steps=0)


def test_breakdown_reads_real_profiler_rows():
    a, b = torch.randn(64, 64), torch.randn(4, 64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        a @ a, b @ b, a + 1
    rows = prof.key_averages()
    assert {"aten::mm", "aten::bmm", "aten::add"} <= {r.key for r in rows}
    assert gpu_time_breakdown(rows) == {"total": 0.0}  # CPU only: no device time anywhere


def test_bench_profile_on_cpu_writes_the_operator_tables(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    small = {
        "model.hidden_size": 32, "model.intermediate_size": 64, "model.num_attention_heads": 2,
        "model.num_hidden_layers": 1, "poet.block_size": 8, "train.batch_size": 2,
        "train.seq_len": 8, "data.vocab_size": 300,
    }  # fmt: skip
    sets = [x for k, v in small.items() for x in ("--set", f"{k}={v}")]
    prof = tmp_path / "p" / "prof.txt"
    args = ["--steps", "1", "--device", "cpu", "--profile", str(prof)]
    assert main(["bench", "--recipe", "recipes/tiny/poetxq.yaml", *sets, *args]) == 0
    text = prof.read_text()
    assert text.startswith("tiny-poetxq (mem): ") and "ms/step timed" in text
    assert "Self CPU" in text and "aten::mm" in text  # the CPU operator table
    assert f"profile written to {prof}" in capsys.readouterr().out
    # a directory as the profile path, or the --out file: one line, before any work
    assert main(["bench", "--recipe", "recipes/tiny/poetxq.yaml", "--profile", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--profile" in err[0] and "is a directory" in err[0]
    same = str(tmp_path / "same.txt")
    assert main(["bench", "--recipe", "recipes/tiny/poetxq.yaml", "--profile", same,
                 "--out", same]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--profile and --out are the same file" in err[0]
    assert not (tmp_path / "same.txt").exists()
