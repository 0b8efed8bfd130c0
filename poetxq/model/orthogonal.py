"""Block-stochastic orthogonal factors for POET-X (arXiv 2506.08001, 2603.05500).

One side of a POET-X layer (the input side ``P`` over ``n`` features, or the output side ``R``
over ``m``) is ``Ψᵀ · BD(G) · Ψ``: a random permutation ``Ψ`` and a block-diagonal of
``nb = ⌈d/b⌉`` orthogonal ``b×b`` blocks ``G`` given by the Cayley–Neumann parameterization of a
skew-symmetric ``Q`` (only its strict upper triangle is stored: ``b(b-1)/2`` numbers per block).

Ragged dimensions (``d`` not a multiple of ``b``) are handled by padding to ``nb·b`` with a *masked*
last block: the packed entries of ``Q`` that touch padded coordinates are held at zero, so that
block is ``diag(G_r, I)`` with ``G_r`` the CNP of an ``r×r`` skew matrix — still orthogonal on the
``r`` real coordinates, which never mix with the (zero) padding.

Fully stochastic (POET-FS, arXiv 2506.08001 §3.2; ``structure="full"``): one ``b×b`` orthogonal
block rotates a random subset of ``b`` coordinates (the first ``b`` of the permuted order) and
every other coordinate is left alone; a merge draws a new permutation, so a new subset. It is
built as the block-stochastic side with every block but the first masked to ``Q = 0``
(``G = I``): the same kernels, checkpoints and merges, at the block-stochastic side's cost.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import quant_kernels
from poetxq.model.config import check_block_size
from quant_kernels.policy import KernelPolicy, default_policy


def num_blocks(dim: int, block_size: int) -> int:
    """``⌈dim / b⌉``."""
    return math.ceil(dim / block_size)


def packed_size(block_size: int) -> int:
    """Entries in the strict upper triangle of a ``b×b`` block: ``b(b-1)/2``."""
    return block_size * (block_size - 1) // 2


def ragged_mask(dim: int, block_size: int) -> torch.Tensor | None:
    """Mask ``[nb, b(b-1)/2]`` (1 = trainable) for a ragged last block; ``None`` if ``b | dim``."""
    b = block_size
    nb = num_blocks(dim, b)
    r = dim - (nb - 1) * b
    if r == b:
        return None
    iu = torch.triu_indices(b, b, 1)
    mask = torch.ones(nb, packed_size(b))
    # A packed entry (i, j), i < j, is valid in the last block iff j < r (then also i < r).
    mask[-1] = (iu[1] < r).float()
    return mask


#: ``structure`` of a side: block-stochastic (POET-BS, every block trains) or fully stochastic
#: (POET-FS, one block over a random subset of ``b`` coordinates trains)
STRUCTURES = ("block", "full")


def side_mask(dim: int, block_size: int, structure: str = "block") -> torch.Tensor | None:
    """Mask ``[nb, b(b-1)/2]`` (1 = trainable) of a side: :func:`ragged_mask` for ``"block"``;
    for ``"full"`` ones in the first block only (``b ≤ dim``, so that block is never ragged).

    Raises:
        ValueError: unknown ``structure``.
    """
    if structure not in STRUCTURES:
        raise ValueError(f"unknown structure {structure!r}; choose one of {STRUCTURES}")
    if structure == "block":
        return ragged_mask(dim, block_size)
    mask = torch.zeros(num_blocks(dim, block_size), packed_size(block_size))
    mask[0] = 1.0
    return mask


def random_permutation(dim: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A uniformly random permutation of ``range(dim)`` (int64, CPU)."""
    return torch.randperm(dim, generator=generator)


class OrthogonalSide(nn.Module):
    """One orthogonal factor ``Ψᵀ BD(G) Ψ`` over ``dim`` features with block size ``b``.

    Parameters:
        Q: packed skew parameters ``[nb, b(b-1)/2]``, zero-initialised (``G = I``).
    Buffers:
        perm: ``Ψ`` as a gather index ``[dim]`` (int64): ``(Ψ x) = x[..., perm]``.
        inv_perm: its inverse ``[dim]``.
        mask: ``[nb, b(b-1)/2]`` (:func:`side_mask`): a ragged last block's padding, or with
            ``structure="full"`` every block but the first (absent for ``"block"`` when
            ``b | dim``).

    Args:
        dim: features on this side (``n`` for ``P``, ``m`` for ``R``).
        block_size: ``b``; must satisfy ``2 ≤ b ≤ dim``.
        neumann_terms: Neumann order ``k`` of the CNP.
        generator: RNG for the initial permutation.
        dtype, device: of ``Q``.
        kernels: the kernel policy of :meth:`blocks` (the owning layer's); default
            :func:`quant_kernels.policy.default_policy`.
        structure: ``"block"`` (POET-BS) or ``"full"`` (POET-FS, module docstring).

    Raises:
        ValueError: if ``b < 2`` or ``b > dim``, or an unknown ``structure``.
    """

    #: set by :class:`poetxq.model.blockcache.BlockCache` (batched CNP over all sides of a model)
    block_cache: Any = None
    block_cache_index: int = -1  # this side's position in its block-cache group

    def __init__(
        self,
        dim: int,
        block_size: int,
        *,
        neumann_terms: int = 3,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        kernels: KernelPolicy | None = None,
        structure: str = "block",
    ) -> None:
        super().__init__()
        #: kernel policy of the CNP (set by the owning layer: ``POETXLinear.use_kernels``)
        self.kernels = default_policy() if kernels is None else kernels
        if block_size < 2:
            raise ValueError(f"block size b={block_size} must be >= 2")
        check_block_size(block_size, (dim,))
        self.dim = dim
        self.block_size = block_size
        self.neumann_terms = neumann_terms
        self.nb = num_blocks(dim, block_size)
        self.Q = nn.Parameter(
            torch.zeros(self.nb, packed_size(block_size), dtype=dtype, device=device)
        )
        perm = random_permutation(dim, generator).to(device)
        self.register_buffer("perm", perm)
        self.register_buffer("inv_perm", torch.argsort(perm))
        self.structure = structure
        mask = side_mask(dim, block_size, structure)
        self.register_buffer("mask", None if mask is None else mask.to(device=device, dtype=dtype))

    @property
    def padded_dim(self) -> int:
        """``nb · b``."""
        return self.nb * self.block_size

    @property
    def ragged(self) -> bool:
        """Whether ``b`` does not divide ``dim`` (the last block is padded)."""
        return self.dim % self.block_size != 0

    def num_trainable(self) -> int:
        """Effective trainable entries (masked padding entries excluded)."""
        if self.mask is None:
            return self.Q.numel()
        return int(self.mask.sum().item())

    def blocks(self) -> torch.Tensor:
        """The orthogonal blocks ``G`` ``[nb, b, b]`` (differentiable w.r.t. ``Q``; backward
        recomputes the CNP intermediates instead of keeping them, see
        :func:`quant_kernels.cayley_neumann`)."""
        q = self.Q if self.mask is None else self.Q * self.mask
        return quant_kernels.cayley_neumann(
            q, self.block_size, self.neumann_terms, kernels=self.kernels
        )

    def blocks_as(self, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`blocks` cast to ``dtype``, taken from the model's batched
        :class:`poetxq.model.blockcache.BlockCache` when one holds fresh blocks for this side."""
        # under torch.compile each side's own CNP: the cache's staleness checks (Q._version)
        # cannot be traced, and the compiler batches and fuses the CNPs itself
        cache = None if torch.compiler.is_compiling() else self.block_cache
        g = cache.blocks(self, dtype) if cache is not None else None
        return g if g is not None else self.blocks().to(dtype)

    @torch.no_grad()
    def reinitialize(self, generator: torch.Generator | None = None) -> None:
        """Reset ``Q`` to zero and draw a new permutation (the second half of a merge)."""
        self.Q.zero_()
        perm = random_permutation(self.dim, generator).to(self.perm.device)
        self.perm.copy_(perm)
        self.inv_perm.copy_(torch.argsort(perm))

    def dense(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Dense ``Ψᵀ BD(G) Ψ`` ``[dim, dim]`` — for tests and small-model checks only."""
        g = self.blocks().detach().to(dtype)
        bd = torch.block_diag(*g)[: self.dim, : self.dim]
        eye = torch.eye(self.dim, dtype=dtype, device=bd.device)
        psi = eye[self.perm]  # (Ψ x)_i = x[perm[i]]
        return psi.t() @ bd @ psi

    def extra_repr(self) -> str:
        rag = (
            f", ragged last block {self.dim - (self.nb - 1) * self.block_size}"
            if self.ragged
            else ""
        )
        fs = ", fully stochastic (one trained block)" if self.structure == "full" else ""
        return (
            f"dim={self.dim}, b={self.block_size}, blocks={self.nb}, k={self.neumann_terms}"
            f"{rag}{fs}"
        )
