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
    assert quant_kernels.triton_enabled(small)
    for mode in ("fused", "streamed", "torch"):
        monkeypatch.setenv("POETXQ_KERNELS", mode)
        assert quant_kernels.weight_gemm_path(small) == quant_kernels.weight_gemm_path(big) == mode
    assert not quant_kernels.triton_enabled(big)
    monkeypatch.setenv("POETXQ_KERNELS", "bogus")
    with pytest.raises(ValueError, match="POETXQ_KERNELS='bogus'; use one of auto, fused"):
        quant_kernels.weight_gemm_path(small)
