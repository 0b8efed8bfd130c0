"""Group-wise asymmetric low-bit weights and the quantized linear layer of Q-GaLore / Q-APOLLO.

Format (Q-GaLore arXiv 2407.08296 §3): the weight is flattened row-major and cut
into groups of ``g`` consecutive elements. Per group, with ``B`` bits (``L = 2^B − 1``)::

    scale = max(max − min, 1e-5) / L          zero = clamp(−round(min / scale), 0, L)
    code  = clamp(rnd(w / scale) + zero, 0, L)   (uint8)        w ≈ (code − zero) · scale

``rnd`` is round-to-nearest, or stochastic rounding: ``ceil(x)`` with probability ``x − floor(x)``
(given uniform noise ``u``: ``ceil`` when ``u < x − floor(x)``), which is unbiased and lets tiny
updates survive re-quantization on average. A ragged last group is padded with copies of the last
element (which leaves its min/max unchanged); the padding never reaches the caller.

4-bit codes are packed two per byte, first element in the high nibble (bitsandbytes' order).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _grouped(flat: torch.Tensor, group_size: int) -> torch.Tensor:
    """``flat`` [N] → [ceil(N/g), g], the ragged last group padded with its last element."""
    n = flat.numel()
    pad = -n % group_size
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    return flat.reshape(-1, group_size)


def quantize_groupwise(
    w: torch.Tensor, group_size: int, bits: int = 8, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of ``w`` in groups of ``group_size`` (module docstring).

    Args:
        w: float tensor, any shape (computed in fp32).
        group_size: elements per group ``g`` (> 0).
        bits: code width B, 1..8.
        noise: uniform [0, 1) noise of ``w``'s shape for stochastic rounding; None = nearest.

    Returns:
        ``(codes, scales, zeros)``: codes uint8 of ``w``'s shape (one code per byte, unpacked);
        scales and zeros fp32 ``[ceil(numel/g), 1]``.

    Raises:
        ValueError: bad ``bits``/``group_size`` or ``noise`` of another shape.
    """
    if not 1 <= bits <= 8 or group_size <= 0:
        raise ValueError(f"need 1 <= bits <= 8 and group_size > 0, got {bits}, {group_size}")
    if noise is not None and noise.shape != w.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} != weight shape {tuple(w.shape)}")
    levels = 2**bits - 1
    x = _grouped(w.detach().float().reshape(-1), group_size)
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    scales = (hi - lo).clamp(min=1e-5) / levels
    zeros = (-torch.round(lo / scales)).clamp(0, levels)
    y = x / scales
    if noise is None:
        r = torch.round(y)
    else:
        u = _grouped(noise.float().reshape(-1), group_size)
        down = torch.floor(y)
        r = torch.where(u < y - down, torch.ceil(y), down)
    codes = (r + zeros).clamp(0, levels).to(torch.uint8)
    return codes.reshape(-1)[: w.numel()].reshape(w.shape), scales, zeros


def dequantize_groupwise(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_groupwise`: ``(code − zero) · scale``, shape of ``codes``."""
    c = _grouped(codes.reshape(-1), group_size).to(torch.float32)
    w = (c - zeros) * scales
    return w.reshape(-1)[: codes.numel()].reshape(codes.shape).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15], any shape → uint8 [ceil(N/2)], first element in the high nibble."""
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.reshape(-1, 2)
    return (pairs[:, 0] << 4) | (pairs[:, 1] & 0xF)


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 [numel] codes."""
    out = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)
    return out[:numel]


class _DequantLinearFn(torch.autograd.Function):
    """``y = x · deq(W)ᵀ + b``; backward re-dequantizes (no float weight is kept) and accumulates
    ``∂L/∂W`` (fp32) into ``module.float_grad`` instead of returning it."""

    @staticmethod
    def forward(ctx, x, bias, module):  # type: ignore[override]
        ctx.module = module
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x)
        return F.linear(x, module.dequantize(x.dtype), bias)

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        module: QuantLinear = ctx.module
        gx = gy @ module.dequantize(gy.dtype)
        g2 = gy.reshape(-1, gy.shape[-1])
        gw = (g2.t() @ x.reshape(-1, x.shape[-1])).float()
        module.accumulate_grad(gw)
        gb = g2.sum(0) if ctx.has_bias else None
        return gx, gb, None


class QuantLinear(nn.Module):
    """A linear layer whose weight lives only as group-wise asymmetric 8-bit codes.

    The optimizer updates the weight in place: dequantize → add the update → re-quantize
    (:meth:`set_weight`, stochastic rounding by default). Its gradient is not ``weight.grad`` (an
    integer tensor cannot hold one) but ``float_grad``, fp32 [out, in], accumulated over
    micro-batches by the backward and cleared by the optimizer's ``zero_grad``.

    Attributes:
        weight: ``nn.Parameter`` uint8 [out, in], ``requires_grad=False`` (the codes).
        scales, zeros: fp32 buffers [ceil(out·in/g), 1].
        bias: optional trainable fp32 [out].
        group_size: ``g``; stochastic_round: rounding used by :meth:`set_weight`.
        float_grad: fp32 [out, in] or None.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        group_size: int = 256,
        stochastic_round: bool = True,
    ) -> None:
        """Quantize ``weight`` [out, in] (round to nearest, as the authors' initial quantization).

        Raises:
            ValueError: ``weight`` is not 2-D.
        """
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size
        self.stochastic_round = stochastic_round
        codes, scales, zeros = quantize_groupwise(weight, group_size, 8)
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.bias = nn.Parameter(bias.detach().clone().float()) if bias is not None else None
        self.float_grad: torch.Tensor | None = None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, group_size: int = 256, stochastic_round: bool = True
    ) -> QuantLinear:
        """A :class:`QuantLinear` holding ``linear``'s weight (and bias) quantized."""
        return cls(linear.weight.data, linear.bias, group_size=group_size,
                   stochastic_round=stochastic_round)  # fmt: skip

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as ``dtype`` [out, in]."""
        return dequantize_groupwise(self.weight, self.scales, self.zeros, self.group_size, dtype)

    @torch.no_grad()
    def set_weight(self, w: torch.Tensor, noise: torch.Tensor | None = None) -> None:
        """Re-quantize ``w`` [out, in] into the codes in place (``noise``: see quantize)."""
        codes, scales, zeros = quantize_groupwise(w, self.group_size, 8, noise)
        self.weight.copy_(codes)
        self.scales.copy_(scales)
        self.zeros.copy_(zeros)

    def accumulate_grad(self, g: torch.Tensor) -> None:
        """Add ``g`` (fp32 [out, in]) to ``float_grad``."""
        self.float_grad = g if self.float_grad is None else self.float_grad + g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return _DequantLinearFn.apply(x, bias, self)

    def nbytes(self) -> int:
        """Bytes of the stored weight: codes + scales + zeros."""
        return self.weight.numel() + 8 * self.scales.numel()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits=8, group_size={self.group_size}, stochastic_round={self.stochastic_round}"
        )


def quantize_linears(
    model: nn.Module, target_modules: list[str], *, group_size: int, stochastic_round: bool
) -> list[str]:
    """Swap every ``nn.Linear`` whose last name is in ``target_modules`` for a :class:`QuantLinear`.

    Returns:
        The swapped module paths, in module order.

    Raises:
        ValueError: no such module.
    """
    names = [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in target_modules
    ]
    if not names:
        raise ValueError(f"no nn.Linear named one of {target_modules} found in the model")
    for name in names:
        lin = model.get_submodule(name)
        parent, _, child = name.rpartition(".")
        new = QuantLinear.from_linear(lin, group_size=group_size, stochastic_round=stochastic_round)
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return names


def groups_of(numel: int, group_size: int) -> int:
    """Number of quantization groups for ``numel`` elements."""
    return math.ceil(numel / group_size)
