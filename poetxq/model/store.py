"""What a POET-X(Q) layer's GEMMs multiply by: its frozen ``W0`` store seen through the layer's
kernel policy (and, for 4-bit stores, through ``P``'s permutation), in both the row-major and
the feature-major layout (:mod:`poetxq.model.layout`); the GEMMs themselves are the store's
weight format's (:mod:`quant_kernels.formats`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

import quant_kernels
from poetxq.model.orthogonal import OrthogonalSide
from poetxq.model.quant import FrozenWeight
from quant_kernels.policy import KernelPolicy


class FrozenStore:
    """What a layer's GEMMs multiply by: its frozen store ``W'`` under the layer's kernel policy.

    With ``side_p`` (4-bit stores) the store keeps its columns in the *original* input order,
    ``W'' = Ψ_m W0``: 4-bit blockwise formats quantize 64 consecutive entries of the flattened
    weight together; with ``n`` a multiple of the blocksize a block lies within one row, so
    permuting rows only reorders blocks, but permuting columns would regroup them at every merge
    (quantization drift) and make an exported weight one extra rounding away from the trained
    one. The cost is one more gather per GEMM: ``z`` (in ``P``'s permuted order) is put back in
    input order before ``W''``, and the transposed product is permuted again.
    """

    def __init__(
        self, frozen: FrozenWeight, kernels: KernelPolicy, side_p: OrthogonalSide | None = None
    ) -> None:
        self.frozen, self.kernels, self.side_p = frozen, kernels, side_p

    def matmul(self, z: torch.Tensor) -> torch.Tensor:
        """``z @ W'ᵀ``: ``z [..., n]`` in ``P``'s permuted order → ``[..., m]``."""
        if self.side_p is not None:
            z = quant_kernels.permute_last(z, self.side_p.inv_perm)
        return self.frozen.gemms().matmul(z, kernels=self.kernels)

    def matmul_t(self, dh: torch.Tensor) -> torch.Tensor:
        """``dh @ W'``: ``[..., m]`` → ``[..., n]`` in ``P``'s permuted order."""
        dz = self.frozen.gemms().matmul_t(dh, kernels=self.kernels)
        return dz if self.side_p is None else quant_kernels.permute_last(dz, self.side_p.perm)

    # feature-major (``[features, T]``): the permutations become gathers of whole rows
    def _to_store_fm(self, zt: torch.Tensor) -> torch.Tensor:
        return zt if self.side_p is None else zt.index_select(0, self.side_p.inv_perm)

    def _from_store_fm(self, dzt: torch.Tensor) -> torch.Tensor:
        return dzt if self.side_p is None else dzt.index_select(0, self.side_p.perm)

    def matmul_fm(self, zt: torch.Tensor) -> torch.Tensor:
        """``W' zᵀ``: ``[n, T]`` → ``[m, T]`` (:meth:`quant_kernels.WeightFormat.matmul_fm`)."""
        return self.frozen.gemms().matmul_fm(self._to_store_fm(zt), kernels=self.kernels)

    def matmul_t_fm(self, dht: torch.Tensor) -> torch.Tensor:
        """``W'ᵀ dhᵀ``: ``[m, T]`` → ``[n, T]`` (:meth:`quant_kernels.WeightFormat.matmul_t_fm`)."""
        return self._from_store_fm(self.frozen.gemms().matmul_t_fm(dht, kernels=self.kernels))

    def backward_fm(
        self,
        zt: torch.Tensor,
        dht: torch.Tensor,
        row_align: int,
        on_rows: Callable[[int, torch.Tensor], None],
    ) -> torch.Tensor:
        """The recompute ``W' zᵀ`` (to ``on_rows``) and the returned ``W'ᵀ dhᵀ`` of a ``mem``
        backward (:meth:`quant_kernels.WeightFormat.backward_fm`)."""
        zt = self._to_store_fm(zt)
        dzt = self.frozen.gemms().backward_fm(zt, dht, row_align, on_rows, kernels=self.kernels)
        return self._from_store_fm(dzt)
