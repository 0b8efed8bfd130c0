"""int8 row-wise store vs bitsandbytes' own quantizer (the oracle)."""

import pytest
import torch

from poetxq.model.quant import DenseWeight, Int8RowwiseWeight, make_frozen_weight
from quant_kernels.reference import (
    dequant_int8_rowwise,
    int8_rowwise_matmul,
    int8_rowwise_matmul_t,
    quantize_int8_rowwise,
)

bnb_functional = pytest.importorskip("bitsandbytes.functional")


@pytest.mark.parametrize("shape", [(1, 7), (33, 65), (128, 256)])
@pytest.mark.parametrize("chunk", [None, 1, 200])  # elements per pass: one row, a few rows
def test_int8_matches_bitsandbytes(shape, chunk, gen, monkeypatch):
    """Quantized in chunks of whole rows (``QUANT_CHUNK_ELEMENTS``) or in one pass, the codes
    are bitsandbytes' own."""
    if chunk is not None:
        monkeypatch.setattr("quant_kernels.reference.QUANT_CHUNK_ELEMENTS", chunk)
    w = (torch.randn(shape, generator=gen) * 3).to(torch.float16)
    w[-1, :] = 0  # an all-zero row (in the last chunk)
    cb_ref, scb_ref, _ = bnb_functional.int8_vectorwise_quant(w.clone())
    cb, scb = quantize_int8_rowwise(w)
    assert cb.dtype == torch.int8 and scb.dtype == torch.float32
    assert torch.equal(cb[:-1], cb_ref[:-1]) and torch.equal(scb[:-1], scb_ref[:-1])
    assert not cb[-1].any() and scb[-1] == 0  # bitsandbytes gives NaN codes there
    if shape[0] == 1:
        return
    cb_ref, scb_ref = cb_ref[:-1], scb_ref[:-1]
    cb, scb = cb[:-1], scb[:-1]
    deq_ref = bnb_functional.int8_vectorwise_dequant(cb_ref, scb_ref)
    torch.testing.assert_close(dequant_int8_rowwise(cb, scb), deq_ref.float(), rtol=0, atol=1e-6)


def test_int8_store_layout_and_gemms(gen):
    w = torch.randn(24, 40, generator=gen)
    store = Int8RowwiseWeight(w)
    sd = store.state_dict()
    assert set(sd) == {"weight", "SCB", "weight_format"}
    assert sd["weight"].dtype == torch.int8 and sd["weight_format"].item() == 0
    deq = store.dequantize()
    assert (deq - w).abs().max() <= w.abs().amax(1).max() / 127 / 2 + 1e-6  # half a step
    x = torch.randn(5, 40, generator=gen)
    g = torch.randn(5, 24, generator=gen)
    torch.testing.assert_close(store.gemms().matmul(x), x @ deq.t())
    torch.testing.assert_close(store.gemms().matmul_t(g), g @ deq)
    torch.testing.assert_close(int8_rowwise_matmul(x, sd["weight"], sd["SCB"]), x @ deq.t())
    torch.testing.assert_close(int8_rowwise_matmul_t(g, sd["weight"], sd["SCB"]), g @ deq)
    assert store.nbytes() == 24 * 40 + 24 * 4 + 1


def test_zero_row_and_stochastic_rounding_is_unbiased(gen):
    w = torch.randn(4, 16, generator=gen)
    w[2] = 0
    cb, scb = quantize_int8_rowwise(w)
    assert scb[2] == 0 and cb[2].abs().max() == 0
    draws = torch.stack(
        [dequant_int8_rowwise(*quantize_int8_rowwise(w, stochastic=True, generator=gen))
         for _ in range(2000)]
    )  # fmt: skip
    step = (scb / 127).unsqueeze(1)
    sigma = step / 2 / 2000**0.5  # std of a draw <= step/2
    assert torch.all((draws.mean(0) - w).abs() <= 3 * sigma + 1e-7)


def test_make_frozen_weight():
    w = torch.randn(3, 4)
    assert isinstance(make_frozen_weight(w, 8), Int8RowwiseWeight)
    assert isinstance(make_frozen_weight(w, 16), DenseWeight)
    with pytest.raises(ValueError, match="bits=3"):
        make_frozen_weight(w, 3)


@pytest.mark.parametrize("kind", ["int8", "nf4", "dense"])
def test_feature_major_matmuls_equal_the_row_major_ones(kind):
    """WeightFormat.matmul_fm / matmul_t_fm (feature-major in and out) are the transposes of
    matmul / matmul_t for every store."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen)
    store = make_frozen_weight(w, {"int8": 8, "nf4": 4, "dense": 16}[kind])
    z = torch.randn(13, 64, generator=gen)
    dh = torch.randn(13, 96, generator=gen)
    ht = store.gemms().matmul_fm(z.t().contiguous())
    assert ht.shape == (96, 13) and ht.is_contiguous()
    torch.testing.assert_close(ht, store.gemms().matmul(z).t(), rtol=1e-5, atol=1e-5)
    dzt = store.gemms().matmul_t_fm(dh.t().contiguous())
    assert dzt.shape == (64, 13) and dzt.is_contiguous()
    torch.testing.assert_close(dzt, store.gemms().matmul_t(dh).t(), rtol=1e-5, atol=1e-5)
