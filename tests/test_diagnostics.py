"""poetxq.model.diagnostics against hand-computed values (float64) and the dense R·W0·P."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from poetxq.model.diagnostics import (
    DRIFT_WARNING,
    REQUANT_KEY,
    LayerDiagnostics,
    direction_cosines,
    hyperspherical_energy,
    orthogonality_error,
    quantiles,
    spectrum_drift,
)
from poetxq.model.layer import POETXLinear


def test_spectrum_drift_is_the_largest_change_over_the_largest_value():
    ref = torch.tensor([3.0, 2.5, 1.0], dtype=torch.float64)
    assert spectrum_drift(torch.tensor([3.0, 2.0, 1.0]), ref) == pytest.approx(0.5 / 3)
    assert spectrum_drift(ref, ref) == 0.0
    with pytest.raises(ValueError, match="singular values"):
        spectrum_drift(ref[:2], ref)


def test_orthogonality_error_of_a_stretched_block_and_a_rotation():
    c, s = math.cos(0.3), math.sin(0.3)
    rot = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    stretched = torch.diag(torch.tensor([1.1, 1.0], dtype=torch.float64))
    assert orthogonality_error(torch.stack([rot, rot])) < 1e-15
    # GᵀG − I = diag(0.21, 0): spectral norm 0.21, the worst block wins
    assert orthogonality_error(torch.stack([rot, stretched])) == pytest.approx(0.21)
    with pytest.raises(ValueError, match=r"\[nb, b, b\]"):
        orthogonality_error(rot)


def test_hyperspherical_energy_by_hand_and_for_gaussian_neurons():
    # e1, e2, -e1 at arbitrary norms: distances √2, 2, √2 between unit rows
    w = torch.tensor([[2.0, 0.0], [0.0, 5.0], [-0.5, 0.0]], dtype=torch.float64)
    assert hyperspherical_energy(w) == pytest.approx((math.sqrt(2) + 0.5) / 3)
    gauss = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))
    assert hyperspherical_energy(gauss) == pytest.approx(1 / math.sqrt(2), abs=0.01)
    with pytest.raises(ValueError, match="all zeros"):
        hyperspherical_energy(torch.zeros(2, 3))


def test_direction_cosines_and_quantiles():
    w = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    w0 = torch.tensor([[2.0, 2.0], [0.0, 1.0]])
    cos = direction_cosines(w, w0)
    assert cos.dtype == torch.float64
    assert cos.tolist() == pytest.approx([1 / math.sqrt(2), 1.0])
    assert quantiles(torch.arange(5.0), (0.0, 0.5, 1.0)) == [0.0, 2.0, 4.0]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_orthogonality_error_of_cnp_blocks_follows_the_eigen_angles(k):
    """A skew Q with planes rotated by angles θ: the CNP polynomial is normal, and scales each
    plane by |1 − (iθ)^(k+1)| (the Neumann sum of (I − Q)^-1 times I + Q), so the error is
    max |(1 − (iθ)^(k+1))|² − 1|; for k = 3 the plane at θ = 1 collapses (G = 0 there)."""
    from quant_kernels.reference import cnp_from_skew

    thetas = [0.3, 1.0, 1.4]
    q = torch.zeros(1, 6, 6, dtype=torch.float64)
    for j, t in enumerate(thetas):
        q[0, 2 * j, 2 * j + 1], q[0, 2 * j + 1, 2 * j] = t, -t
    g = cnp_from_skew(q, k)
    scale = [abs(1 - (1j * t) ** (k + 1)) for t in thetas]
    want = max(abs(s**2 - 1) for s in scale)
    assert orthogonality_error(g) == pytest.approx(want, rel=1e-9)
    sv = torch.linalg.svdvals(g[0]).sort().values.tolist()
    assert sv == pytest.approx(sorted(s for s in scale for _ in range(2)), abs=1e-12)
    if k == 3:
        assert torch.linalg.matrix_norm(g[0, 2:4, 2:4]) < 1e-12  # θ = 1: the plane is gone


def _layer(bits: int, seed: int = 0) -> POETXLinear:
    g = torch.Generator().manual_seed(seed)
    return POETXLinear(24, 40, block_size=8, bits=bits, generator=g)


def test_a_fresh_layer_has_moved_nowhere():
    d = LayerDiagnostics(_layer(16), sample=16, generator=torch.Generator().manual_seed(1))
    out = d.measure()
    assert out["sigma_drift_init"] == 0.0 and out["sigma_drift_w0"] < 1e-6
    assert out["orth_error"] < 1e-6
    assert out["cos"] == pytest.approx([1.0] * 5)
    assert d.rows.numel() == 16 and d.w_init.shape == (16, 24)


def test_measure_matches_the_dense_reference_after_training_moves_q():
    layer = _layer(16)
    d = LayerDiagnostics(layer, sample=100)  # fewer rows than that: all 40 kept
    w_start = (layer.R.dense() @ layer.stored_w0(torch.float64) @ layer.P.dense()).clone()
    with torch.no_grad():
        for side in (layer.P, layer.R):
            side.Q.copy_(
                0.05 * torch.randn(side.Q.shape, generator=torch.Generator().manual_seed(2))
            )
    out = d.measure()
    dense = layer.R.dense() @ layer.stored_w0(torch.float64) @ layer.P.dense()
    sig = torch.linalg.svdvals(dense)
    ref = torch.linalg.svdvals(w_start)
    assert out["sigma_drift_init"] == pytest.approx(
        float((sig - ref).abs().max() / ref.max()), rel=1e-3, abs=1e-6
    )
    blocks = torch.cat([layer.P.blocks(), layer.R.blocks()]).double()
    eye = torch.eye(8, dtype=torch.float64)
    want = max(torch.linalg.matrix_norm(b.t() @ b - eye, ord=2).item() for b in blocks)
    assert out["orth_error"] == pytest.approx(want, rel=1e-4)
    assert 0 < out["orth_error"] < 0.1  # k = 3 Neumann terms: small, not zero
    cos = direction_cosines(dense, w_start)
    assert out["cos"] == pytest.approx(quantiles(cos), abs=1e-6)
    assert out["cos"][0] < 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measure_on_cuda_matches_the_cpu_measure():
    """Every tensor the diagnostics make follows the layer's device (the quantile ``q``
    tensor once did not: a CUDA run failed at its first diagnostics step)."""
    cpu = _layer(8)
    with torch.no_grad():
        cpu.R.Q.copy_(0.05 * torch.randn(cpu.R.Q.shape, generator=torch.Generator().manual_seed(6)))
    gpu = _layer(8).cuda()
    gpu.load_state_dict(cpu.state_dict())
    want = LayerDiagnostics(cpu, sample=16, generator=torch.Generator().manual_seed(1)).measure()
    got = LayerDiagnostics(gpu, sample=16, generator=torch.Generator().manual_seed(1)).measure()
    assert got["cos"] == pytest.approx(want["cos"], abs=1e-5)
    assert got["orth_error"] == pytest.approx(want["orth_error"], rel=1e-3, abs=1e-7)
    assert got["energy"] == pytest.approx(want["energy"], rel=1e-5)


def test_a_merge_resets_the_period_drift_and_int8_keeps_its_quantization_drift():
    layer = _layer(8)
    d = LayerDiagnostics(layer, sample=8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for side in (layer.P, layer.R):
            side.Q.copy_(
                0.05 * torch.randn(side.Q.shape, generator=torch.Generator().manual_seed(4))
            )
    before = d.measure()
    layer.merge_then_reinitialize(torch.Generator().manual_seed(5))
    after = d.measure()
    assert after["orth_error"] < 1e-6 < before["orth_error"]  # Q = 0 again
    assert after["sigma_drift_w0"] < 1e-6  # R = P = I: W is the stored W0
    # what stays: the re-quantized W0's spectrum is not the start's (int8 rounding)
    assert 1e-5 < after["sigma_drift_init"] < 0.05


_TINY_RUN = [
    "train", "--data", "pydoc", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "8",
    "--set", "poet.block_size=16", "--eval-every", "0", "--no-progress",
    "--set", "model.hidden_size=64", "--set", "model.intermediate_size=136",
    "--set", "model.num_attention_heads=4", "--set", "model.num_hidden_layers=1",
    "--set", "optim.warmup_steps=2", "--max-steps", "6", "--set", "poet.merge_interval=4",
    "--set", "train.diagnostics_every=2", "--set", "train.save_checkpoint=false",
]  # fmt: skip


def _diag_records(run: Path) -> dict[int, dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(ln) for ln in lines]
    return {r["step"]: r for r in recs if "diag_orth_error" in r}


def test_training_logs_the_diagnostics_and_notes_a_drifting_run(
    tmp_path, monkeypatch, capsys, cpu_only
):
    from poetxq.tools.cli import main

    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    assert main([*_TINY_RUN, "--output-dir", str(tmp_path), "--run-name", "ok"]) == 0
    diag = _diag_records(tmp_path / "ok")
    assert sorted(diag) == [0, 2, 4, 6]
    assert diag[0]["diag_orth_error"] < 1e-6 and diag[0]["diag_cos_min"] == pytest.approx(1.0)
    assert diag[0]["diag_energy"] == pytest.approx(1 / math.sqrt(2), abs=0.1)  # Gaussian init
    assert 0 < diag[2]["diag_sigma_drift_w0"] < DRIFT_WARNING and diag[2]["diag_orth_error"] > 0
    assert diag[2]["diag_cos_min"] < 1.0
    # the step-4 record is taken before that step's merge: this period's drift is in it
    assert diag[4]["diag_sigma_drift_w0"] > 0
    assert "note: at step" not in capsys.readouterr().out
    recs = [json.loads(ln) for ln in (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()]
    requant = [(r["step"], r[REQUANT_KEY]) for r in recs if REQUANT_KEY in r]
    assert [s for s, _ in requant] == [4] and 1e-4 < requant[0][1] < 1e-2  # int8, one merge
    # a rotation lr far too high: the one note, naming the knobs
    high = [*_TINY_RUN, "--set", "optim.poet_lr=3.0", "--set", "optim.grad_clip=0"]
    assert main([*high, "--output-dir", str(tmp_path), "--run-name", "hot"]) == 0
    out = capsys.readouterr().out
    assert out.count("note: at step") == 1 and "optim.poet_lr" in out
    assert max(r["diag_sigma_drift_w0"] for r in _diag_records(tmp_path / "hot").values()) > 0.05
    # poetxq report draws them beside the usual plots
    from poetxq.tools.report import build_report

    md = build_report([tmp_path / "ok", tmp_path / "hot"], tmp_path / "report").read_text()
    assert "](diagnostics.png)" in md
    png = (tmp_path / "report" / "diagnostics.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_a_resumed_run_measures_against_the_same_reference_as_an_uninterrupted_one(
    tmp_path, monkeypatch, cpu_only
):
    """The diagnostics' reference is the model as built (step 0), not the model at the resume:
    a run stopped after step 2 and resumed logs the records of the run that never stopped (on
    the CPU, where a resume is bit-exact; a GPU's kernels differ in the last bits)."""
    import shutil

    from poetxq.tools.cli import main
    from poetxq.training.checkpoint import list_checkpoints

    monkeypatch.setenv("POETXQ_CACHE", str(tmp_path / "cache"))
    argv = [*_TINY_RUN, "--set", "train.save_checkpoint=true", "--save-every", "2",
            "--keep-last", "4", "--output-dir", str(tmp_path)]  # fmt: skip
    assert main([*argv, "--run-name", "whole"]) == 0
    whole = _diag_records(tmp_path / "whole")
    # the same run as if stopped at step 2: its later checkpoints and results never written
    run = tmp_path / "stopped"
    shutil.copytree(tmp_path / "whole", run)
    for step, path in list_checkpoints(run):
        if step > 2:
            shutil.rmtree(path)
    for name in ("summary.json", "model.safetensors"):
        (run / name).unlink(missing_ok=True)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    resumed = _diag_records(run)
    assert sorted(resumed) == [0, 2, 4, 6]
    for step in (4, 6):  # the merge at step 4 and the drift since step 0, as if never stopped
        assert resumed[step]["diag_sigma_drift_init"] > 0
        assert resumed[step] == whole[step]


def test_merge_measures_the_requantization_error_against_an_int8_reference():
    layer = _layer(8)
    with torch.no_grad():
        for side in (layer.P, layer.R):
            side.Q.copy_(
                0.05 * torch.randn(side.Q.shape, generator=torch.Generator().manual_seed(6))
            )
    w = layer.effective_weight(torch.float64)
    err = layer.merge_then_reinitialize(torch.Generator().manual_seed(7), measure=True)
    # row-wise absmax int8 (bitsandbytes LLM.int8 layout: q = round(127 w / absmax)) by hand
    absmax = w.abs().amax(dim=1, keepdim=True)
    deq = torch.round(w * 127 / absmax) * absmax / 127
    assert err == pytest.approx(float((deq - w).norm() / w.norm()), rel=1e-5)
    assert 1e-4 < err < 1e-2
    assert _layer(16).merge_then_reinitialize(measure=True) == pytest.approx(0.0, abs=1e-7)
    assert _layer(8).merge_then_reinitialize() is None
