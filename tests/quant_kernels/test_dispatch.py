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


@pytest.mark.skipif(not quant_kernels._HAS_TRITON, reason="triton not installed")
def test_auto_policy_and_overrides(monkeypatch):
    monkeypatch.delenv("POETXQ_KERNELS", raising=False)
    small, big = _FakeCuda(2048), _FakeCuda(8192)
    limit = quant_kernels.FUSED_INT8_FORWARD_MAX_M
    assert quant_kernels.triton_enabled(small, measured_faster=quant_kernels._rows(small) <= limit)
    assert not quant_kernels.triton_enabled(big, measured_faster=quant_kernels._rows(big) <= limit)
    monkeypatch.setenv("POETXQ_KERNELS", "fused")
    assert quant_kernels.triton_enabled(big, measured_faster=False)
    monkeypatch.setenv("POETXQ_KERNELS", "torch")
    assert not quant_kernels.triton_enabled(small, measured_faster=True)
    monkeypatch.setenv("POETXQ_KERNELS", "bogus")
    with pytest.raises(ValueError, match="POETXQ_KERNELS"):
        quant_kernels.triton_enabled(small)
