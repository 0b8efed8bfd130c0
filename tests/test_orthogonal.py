"""Cayley–Neumann blocks, skew packing and the ragged-block mask."""

import pytest
import torch

from poetxq.model.orthogonal import OrthogonalSide, packed_size, ragged_mask
from quant_kernels.reference import block_diag_matmul, cayley_neumann, skew_from_packed


def test_skew_packing_round_trip(gen):
    b = 5
    packed = torch.randn(3, packed_size(b), generator=gen, dtype=torch.float64)
    q = skew_from_packed(packed, b)
    torch.testing.assert_close(q.transpose(1, 2), -q)
    iu = torch.triu_indices(b, b, 1)
    torch.testing.assert_close(q[:, iu[0], iu[1]], packed)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_cnp_equals_truncated_series_and_obeys_bound(k, gen):
    b = 6
    packed = 0.1 * torch.randn(4, packed_size(b), generator=gen, dtype=torch.float64)
    g = cayley_neumann(packed, b, terms=k)
    q = skew_from_packed(packed, b)
    eye = torch.eye(b, dtype=torch.float64)
    series = sum(torch.linalg.matrix_power(q, j) for j in range(k + 1))
    torch.testing.assert_close(g, (eye + q) @ series)
    # G = C (I - Q^{k+1}) with C the exact Cayley transform, so
    # ||GᵀG - I||_2 <= 2||Q||^{k+1} + ||Q||^{2k+2}.
    qn = torch.linalg.matrix_norm(q, ord=2)
    err = torch.linalg.matrix_norm(g.transpose(1, 2) @ g - eye, ord=2)
    assert torch.all(err <= 2 * qn ** (k + 1) + qn ** (2 * k + 2) + 1e-14)
    assert torch.all(err > 0)  # truncated: not exactly orthogonal
    cayley = (eye + q) @ torch.linalg.inv(eye - q)
    assert torch.all(torch.linalg.matrix_norm(g - cayley, ord=2) <= 2 * qn ** (k + 1))


def test_cnp_zero_is_identity():
    g = cayley_neumann(torch.zeros(2, packed_size(4)), 4)
    torch.testing.assert_close(g, torch.eye(4).expand(2, 4, 4))


def test_block_diag_matmul_equals_dense(gen):
    g = torch.randn(3, 4, 4, generator=gen, dtype=torch.float64)
    x = torch.randn(2, 5, 12, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(block_diag_matmul(x, g), x @ torch.block_diag(*g).t())


def test_ragged_side_is_orthogonal_on_real_coordinates(gen):
    side = OrthogonalSide(10, 4, generator=gen, dtype=torch.float64)  # blocks 4, 4, 2
    assert side.nb == 3 and side.ragged
    assert side.num_trainable() == 2 * 6 + 1
    with torch.no_grad():
        side.Q.copy_(0.05 * torch.randn(side.Q.shape, generator=gen, dtype=torch.float64))
    g = side.blocks()
    # last block = diag(G_2x2, I_2): no mixing between real and padded coordinates
    torch.testing.assert_close(g[-1, 2:, 2:], torch.eye(2, dtype=torch.float64))
    assert g[-1, :2, 2:].abs().max() == 0 and g[-1, 2:, :2].abs().max() == 0
    r = side.dense()
    q = skew_from_packed(side.Q * side.mask, 4)
    qn = torch.linalg.matrix_norm(q, ord=2).max()
    err = torch.linalg.matrix_norm(r @ r.t() - torch.eye(10, dtype=torch.float64), ord=2)
    assert err <= 2 * qn**4 + qn**8


def test_ragged_mask_layout():
    assert ragged_mask(16, 4) is None
    m = ragged_mask(7, 4)  # last block has r = 3 real coordinates: entries (0,1) (0,2) (1,2)
    iu = torch.triu_indices(4, 4, 1)
    expected = ((iu[0] < 3) & (iu[1] < 3)).float()
    torch.testing.assert_close(m[-1], expected)
    torch.testing.assert_close(m[0], torch.ones(6))
