"""evals/kernel_targets.py: the floors by hand, the target rows and the Markdown (no GPU)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kt():
    sys.path.insert(0, str(REPO / "evals"))
    spec = importlib.util.spec_from_file_location(
        "kernel_targets", REPO / "evals/kernel_targets.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_layer_floor_by_hand(kt):
    # 4096 -> 14336, T = 2048, b = 256. Input-side block pass: 4.29e9 FLOP (4.34 us at peak)
    # but 4*2048*4096 = 33.55e6 B (6.99 us at 4.8 TB/s): bytes win. Output side: 117.4e6 B,
    # 24.47 us. Decode: 3 * 4096 * 14336 = 176.2e6 B, 36.70 us each. Permutes: 4*2048*(3*4096
    # + 2*14336) = 335.5e6 B, 69.91 us. CNP of 16 + 56 blocks: 5 * 2 * 256^3 * 72 = 1.208e10
    # FLOP, 12.21 us at peak (above its 3.5e7 B of traffic, 7.3 us).
    f = kt.layer_floor(4096, 14336, linear_ms=1.0)
    assert f["block_passes_ms"] == pytest.approx(4 * 6.990507e-3 + 3 * 24.466773e-3, rel=1e-5)
    assert f["decodes_ms"] == pytest.approx(2 * 36.700160e-3, rel=1e-5)
    assert f["permute_transposes_ms"] == pytest.approx(69.905067e-3, rel=1e-5)
    assert f["cnp_ms"] == pytest.approx(12.2086e-3, rel=1e-4)
    assert f["ratio_floor"] == pytest.approx(1.256876, rel=1e-5)


def test_cnp_and_gemm_floors_by_hand(kt):
    # 11,008 blocks of 256: one [nb, b, b] bf16 pass is 1.4428e9 B = 0.30059 ms; five products
    # are 1.8468e12 FLOP = 1.8666 ms at peak, above the 5.0415e9 B (1.0503 ms) of traffic
    f = kt.cnp_floor(11008, 256, reference_ms=30.0, measured_ms=12.0)
    assert f["pass_ms"] == pytest.approx(0.300589, rel=1e-5)
    assert f["measured_passes"] == pytest.approx(12.0 / 0.300589, rel=1e-5)
    assert f["needed_ms"] == 10.0
    assert f["fused_floor_ms"] == pytest.approx(1.866622, rel=1e-5)
    # int8 8192 x 4096 x 14336: 9.621e11 FLOP = 0.97238 ms; decode 3 B/weight = 36.70 us
    g = kt.gemm_floor(8192, 4096, 14336, bf16_ms=1.0, code_bytes_per_weight=1.0)
    assert g["gemm_flop_floor_ms"] == pytest.approx(0.972380, rel=1e-5)
    assert g["decode_share"] == pytest.approx(0.0367002, rel=1e-5)
    p = kt.peak_floor_mib(4096, 14336)
    assert p == {"activations_mib": 184.0, "weight_bf16_mib": 112.0}


def _doc() -> dict:
    side = {
        "bf16_matmul": {"ms": 1.0, "ratio_vs_bf16": 1.0},
        "int8 default 32MiB balanced": {"ms": 1.04, "ratio_vs_bf16": 1.04},
        "nf4 default 32MiB balanced": {"ms": 1.08, "ratio_vs_bf16": 1.08},
        "bnb_matmul_4bit": {"ms": 1.07, "ratio_vs_bf16": 1.07},
    }
    layer = {
        "shape": "4096->14336",
        "nn_linear": {"gpu_ms_graph": 1.1, "peak_extra_mib": 168.0},
        "bits8_mem": {"gpu_ratio": 1.3, "peak_extra_mib": 300.0},
        "bits16_fast": {"gpu_ratio": 0.87},
        "official_qpoet_mem": {"gpu_ratio": 2.0, "peak_extra_mib": 363.0},
    }
    return {
        "gpu": "NVIDIA H200",
        "date": "2026-12-02T00:00:00Z",
        "commit": "abc1234",
        "torch": "2.11",
        "command": "python evals/kernel_targets.py --out x.json",
        "gemm": [{"M": 8192, "K": 4096, "N": 14336, "forward": side, "dX": side}],
        "cnp_blocks": 11008,
        "cnp": {"ms": {"reference": {"fwd_bwd": 30.0}, "fused_hybrid": {"fwd_bwd": 12.0}}},
        "layers": [layer],
        "correctness": [
            {"shape": "4096->14336", "bits": 8, "fp32": {"y_rel_err": 1e-6, "dx_rel_err": 2e-6}}
        ],
    }


def test_target_rows_judge_each_threshold(kt):
    rows = {r["target"]: r for r in kt.targets(_doc())}
    int8 = rows["int8 weight GEMM ÷ bf16, 8192×4096×14336 forward"]
    assert int8["measured"] == 1.04 and int8["met"] is True
    nf4 = rows["NF4 weight GEMM ÷ bf16, 8192×4096×14336 forward"]
    # within 1.10x but slower than bitsandbytes' forward (1.07): the target has both parts
    assert nf4["faster_than_bnb"] is False and nf4["met"] is False
    # dX: the target names only the forward's bitsandbytes path
    nf4_dx = rows["NF4 weight GEMM ÷ bf16, 8192×4096×14336 dX"]
    assert nf4_dx["faster_than_bnb"] is False and nf4_dx["met"] is True
    cnp = next(r for t, r in rows.items() if t.startswith("CNP"))
    assert cnp["measured"] == 2.5 and cnp["met"] is False
    mem = rows["POET-XQ int8 mem layer fwd+bwd ÷ nn.Linear, 4096→14336"]
    assert mem["met"] is False and mem["official_ratios"] == {"official_qpoet_mem": 2.0}
    assert rows["POET-X bf16 fast layer fwd+bwd ÷ nn.Linear, 4096→14336"]["met"] is True
    peak = rows["POET-XQ int8 mem layer peak extra memory (MiB), 4096→14336"]
    assert peak["threshold"] == 112.0 and peak["met"] is False


def test_render_writes_every_row_from_a_results_file(kt, tmp_path, capsys):
    src = tmp_path / "run.json"
    src.write_text(json.dumps(_doc()))
    md = tmp_path / "run.md"
    assert kt.main(["--render", str(src), "--md", str(md)]) == 0
    page = md.read_text()
    assert "| int8 weight GEMM ÷ bf16, 8192×4096×14336 forward | 1.040 | <= 1.05 | yes |" in page
    assert "| 1.080 (bitsandbytes `matmul_4bit` 1.070) | <= 1.10 | **no** |" in page
    assert "3× needs ≤ 33.3 (10.00 ms)" in page
    assert "4096 → 14336, bits 8: fp32: y 1.0e-06, dX 2.0e-06" in page
    with pytest.raises(SystemExit):
        kt.main(["--render", str(src), "--out", str(tmp_path / "x.json")])
    assert "exactly one of --out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kt.main(["--render", str(tmp_path / "missing.json")])
    assert "cannot read a results JSON" in capsys.readouterr().err
