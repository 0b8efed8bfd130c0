"""Permute-and-transpose kernels vs torch indexing (CPU: Triton interpreter)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "needs a GPU or TRITON_INTERPRET=1 (set by tests/conftest.py)", allow_module_level=True
    )

from quant_kernels.transpose_perm import permute_to_feature_major, permute_to_row_major

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# tokens and features not multiples of the tile (16 x 16 in the interpreter), and single rows
@pytest.mark.parametrize("shape", [(37, 50), (16, 16), (1, 33), (70, 1), (0, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_directions_equal_indexing_exactly(shape, dtype, gen):
    t, d = shape
    x = torch.randn(t, d, generator=gen).to(dtype)
    perm = torch.randperm(d, generator=gen)
    inv = torch.argsort(perm)
    xt = permute_to_feature_major(x.to(DEVICE), inv.to(DEVICE))
    assert xt.shape == (d, t) and xt.dtype == dtype and xt.is_contiguous()
    assert torch.equal(xt.cpu(), x[:, perm].T)
    back = permute_to_row_major(xt, inv.to(DEVICE))  # undo: (xt[inv])ᵀ = x
    assert back.shape == (t, d) and back.is_contiguous()
    assert torch.equal(back.cpu(), x)
    y = permute_to_row_major(x.T.contiguous().to(DEVICE), perm.to(DEVICE))
    assert torch.equal(y.cpu(), x[:, perm])


def test_strided_input_and_other_tiles(gen):
    base = torch.randn(40, 60, generator=gen)
    x = base[:, 7:47]  # row stride 60
    perm = torch.randperm(40, generator=gen)
    got = permute_to_feature_major(x.to(DEVICE), torch.argsort(perm).to(DEVICE), tile=(8, 32))
    assert torch.equal(got.cpu(), x[:, perm].T)
    xt = base.T[5:45]  # [40, 40] with a non-unit column stride: copied first
    got = permute_to_row_major(xt.to(DEVICE), perm.to(DEVICE), tile=(32, 8))
    assert torch.equal(got.cpu(), xt[perm].T)


def test_bad_shapes_are_one_line():
    x = torch.zeros(4, 6)
    with pytest.raises(ValueError, match=r"length 6 \(the feature axis of x\)"):
        permute_to_feature_major(x.to(DEVICE), torch.arange(5).to(DEVICE))
    with pytest.raises(ValueError, match="xt must be 2-D"):
        permute_to_row_major(torch.zeros(2, 3, 4).to(DEVICE), torch.arange(3).to(DEVICE))


@pytest.mark.parametrize("shape", [(37, 50), (1, 33)])
def test_the_cast_rides_along_in_both_directions(shape, gen):
    t, d = shape
    x = torch.randn(t, d, generator=gen)
    perm = torch.randperm(d, generator=gen)
    inv = torch.argsort(perm)
    # fp32 -> bf16 into feature-major: torch's .to() rounds to nearest even, as the GPU does;
    # Triton's CPU interpreter truncates, so there each value is the rounded or the truncated one
    got = permute_to_feature_major(x.to(DEVICE), inv.to(DEVICE), out_dtype=torch.bfloat16).cpu()
    src = x[:, perm].T.contiguous()
    rounded = src.to(torch.bfloat16).float()
    truncated = (src.view(torch.int32) & -65536).view(torch.float32)  # top 16 bits kept
    assert got.dtype == torch.bfloat16 and got.shape == (d, t)
    if DEVICE == "cuda":
        assert torch.equal(got.float(), rounded)
    else:
        assert ((got.float() == rounded) | (got.float() == truncated)).all()
    # bf16 -> fp32 back to row-major: exact everywhere
    back = permute_to_row_major(got.to(DEVICE), inv.to(DEVICE), out_dtype=torch.float32).cpu()
    assert back.dtype == torch.float32 and torch.equal(back, got.float().T[:, inv])
