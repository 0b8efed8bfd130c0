"""Which path quant_kernels' entry points take (the policy is data, so it gets a test)."""

import pytest
import torch

import quant_kernels


class _FakeCuda:
    """Stands in for a CUDA tensor in the policy check only."""

    def __init__(self, rows: int, cols: int = 8) -> None:
        self.is_cuda = True
        self.shape = (rows, cols)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def test_cpu_never_uses_kernels():
    assert not quant_kernels.triton_enabled(torch.zeros(2, 2))
    assert quant_kernels.weight_gemm_path(torch.zeros(4096, 8)) == "torch"


@pytest.mark.skipif(not quant_kernels._HAS_TRITON, reason="triton not installed")
def test_auto_policy_and_overrides(monkeypatch):
    monkeypatch.delenv("POETXQ_KERNELS", raising=False)
    limit = quant_kernels.STREAMED_MIN_M
    small, big = _FakeCuda(limit - 1), _FakeCuda(limit)
    assert quant_kernels.weight_gemm_path(small) == "fused"
    assert quant_kernels.weight_gemm_path(big) == "streamed"
    assert quant_kernels.weight_gemm_path(small, bits=4) == "streamed"  # 4-bit: always
    assert quant_kernels.slab_bytes_for(2048) == 64 * 2**20
    assert quant_kernels.slab_bytes_for(8192) == 32 * 2**20
    assert quant_kernels.triton_enabled(small)
    for mode in ("fused", "streamed", "torch"):
        monkeypatch.setenv("POETXQ_KERNELS", mode)
        assert quant_kernels.weight_gemm_path(small) == quant_kernels.weight_gemm_path(big) == mode
    assert not quant_kernels.triton_enabled(big)
    monkeypatch.setenv("POETXQ_KERNELS", "bogus")
    with pytest.raises(ValueError, match="POETXQ_KERNELS='bogus'; use one of auto, fused"):
        quant_kernels.weight_gemm_path(small)


class _FakeCudaPacked(_FakeCuda):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__(4, 120)
        self.dtype = dtype


@pytest.mark.skipif(not quant_kernels._HAS_TRITON, reason="triton not installed")
def test_fused_cnp_serves_the_dtypes_it_was_measured_faster_for(monkeypatch):
    monkeypatch.delenv("POETXQ_KERNELS", raising=False)
    fp32, bf16 = _FakeCudaPacked(torch.float32), _FakeCudaPacked(torch.bfloat16)
    fp16 = _FakeCudaPacked(torch.float16)
    # evals/results/cnp_hybrid_h200.json: the hybrid layout beats the reference in fp32 and bf16
    assert quant_kernels.FUSED_CNP_MEASURED_FASTER
    assert quant_kernels.FUSED_CNP_BF16_MEASURED_FASTER
    assert quant_kernels._fused_cnp(fp32, 3) and quant_kernels._fused_cnp(bf16, 3)
    assert quant_kernels._fused_cnp(fp16, 3)  # the bf16 kernels, same tensor-core paths
    monkeypatch.setattr(quant_kernels, "FUSED_CNP_BF16_MEASURED_FASTER", False)
    assert not quant_kernels._fused_cnp(bf16, 3) and not quant_kernels._fused_cnp(fp16, 3)
    assert quant_kernels._fused_cnp(fp32, 3)
    monkeypatch.setattr(quant_kernels, "FUSED_CNP_MEASURED_FASTER", False)
    assert not quant_kernels._fused_cnp(fp32, 3)
    monkeypatch.setenv("POETXQ_KERNELS", "fused")
    assert quant_kernels._fused_cnp(fp32, 3) and quant_kernels._fused_cnp(bf16, 3)
    assert not quant_kernels._fused_cnp(fp32, 4)  # only k = 3 is fused
    assert not quant_kernels._fused_cnp(_FakeCudaPacked(torch.float64), 3)
    monkeypatch.setenv("POETXQ_KERNELS", "torch")
    assert not quant_kernels._fused_cnp(bf16, 3)


@pytest.mark.skipif(not quant_kernels._HAS_TRITON, reason="triton not installed")
def test_feature_major_layer_is_the_default_on_cuda_only(monkeypatch):
    # evals/results/feature_major_ab_h200.json: faster in every 8B/13B step setting
    monkeypatch.delenv("POETXQ_KERNELS", raising=False)
    act = _FakeCudaPacked(torch.bfloat16)
    assert quant_kernels.FEATURE_MAJOR_LAYER_MEASURED_FASTER
    assert quant_kernels.ONE_DECODE_BACKWARD_MEASURED_FASTER  # layer_one_decode_h200.json
    assert quant_kernels.feature_major_layer(act)
    assert not quant_kernels.feature_major_layer(_FakeCudaPacked(torch.float64))
    assert not quant_kernels.feature_major_layer(torch.zeros(2, 2, dtype=torch.bfloat16))  # CPU
    monkeypatch.setenv("POETXQ_KERNELS", "torch")
    assert not quant_kernels.feature_major_layer(act)


@pytest.mark.parametrize("entry", ["cayley_neumann", "cayley_neumann_lean"])
def test_cnp_entry_points_use_torch_on_cpu_even_when_forced(entry, monkeypatch):
    monkeypatch.setenv("POETXQ_KERNELS", "fused")
    packed = (torch.randn(3, 28, generator=torch.Generator().manual_seed(0)) * 0.1).double()
    leaf = packed.clone().requires_grad_(True)
    g = getattr(quant_kernels, entry)(leaf, 8, 3)
    ref_leaf = packed.clone().requires_grad_(True)
    ref = quant_kernels.reference.cayley_neumann(ref_leaf, 8, 3)
    assert torch.equal(g, ref)
    d_g = torch.randn(3, 8, 8, dtype=torch.float64)
    g.backward(d_g)
    ref.backward(d_g)
    assert torch.equal(leaf.grad, ref_leaf.grad)


def test_fused_cnp_under_autocast_runs_in_the_autocast_dtype(monkeypatch, gen):
    """fp32 ``Q`` under autocast reaches the fused kernels in bf16 — the dtype autocast gives
    the reference's products, whose ``G`` is bf16 — and the gradient flows back to fp32. (The
    values agree with autocast's run of the reference to bf16 rounding, not bit for bit: there
    the elementwise sums stay fp32.)"""
    from quant_kernels import reference

    seen = []

    def fake_fused(x, b, terms):
        seen.append(x.dtype)
        return reference.cayley_neumann(x, b, terms)

    import quant_kernels.cnp_hybrid as cnp_hybrid

    monkeypatch.setattr(quant_kernels, "_fused_cnp", lambda packed, terms: True)
    monkeypatch.setattr(cnp_hybrid, "cayley_neumann_fused", fake_fused)
    packed = (0.1 * torch.randn(2, 6, generator=gen)).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g = quant_kernels.cayley_neumann_lean(packed, 4)
        with torch.no_grad():
            ref = reference.cayley_neumann(packed, 4, 3)  # autocast's own run of the reference
    assert seen == [torch.bfloat16] and g.dtype == ref.dtype == torch.bfloat16
    assert (g.detach().float() - ref.float()).abs().max().item() <= 2**-7
    g.float().sum().backward()
    assert packed.grad.dtype == torch.float32 and packed.grad.abs().sum() > 0
    quant_kernels.cayley_neumann(packed.detach(), 4)  # no autocast: fp32 goes through as is
    assert seen[-1] == torch.float32
