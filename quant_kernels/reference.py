"""Plain-torch reference implementations of every op the Triton kernels provide.

These functions are the oracle that kernels are tested against and the CPU fallback that the
POET-X(Q) layer calls when no GPU kernel applies. They depend on torch only (never on poetxq or
transformers).

Conventions
-----------
* A linear weight is ``W ∈ R^{m×n}`` (out m, in n); a layer computes ``y = x @ W.T``.
* int8 row-wise ("LLM.int8()" / bitsandbytes ``Int8Params`` layout): ``CB`` int8 ``[m, n]``,
  ``SCB`` fp32 ``[m]`` = max|row|, ``W ≈ CB * SCB[:, None] / 127``.
* Cayley–Neumann parameterization (POET, arXiv 2506.08001): a skew-symmetric ``Q`` is stored as
  its strict upper triangle, row-major (``torch.triu_indices(b, b, 1)`` order), ``b(b-1)/2``
  numbers per ``b×b`` block; ``G = (I + Q)(I + Q + … + Q^k) = I + 2(Q + … + Q^k) + Q^{k+1}``.
* Block-diagonal multiply: ``x`` has last dim ``nb*b``; block ``i`` of the output is
  ``x[..., i*b:(i+1)*b] @ G[i].T`` (i.e. ``BD(G) x`` in column-vector notation).
"""

from __future__ import annotations

import torch

__all__ = [
    "block_diag_matmul",
    "cayley_neumann",
    "cnp_from_skew",
    "dequant_int8_rowwise",
    "int8_rowwise_matmul",
    "int8_rowwise_matmul_t",
    "permute_last",
    "quantize_int8_rowwise",
    "skew_from_packed",
]


# ----------------------------------------------------------------------------------------------
# int8 row-wise absmax (bitsandbytes Int8Params / LLM.int8 layout)
# ----------------------------------------------------------------------------------------------


#: elements the reference quantizers work on at a time (whole rows in
#: :func:`quantize_int8_rowwise`, whole blocks in ``reference_4bit.quantize_4bit_blockwise``),
#: so their fp32 / int64 temporaries stay at one chunk's size, not the weight's
QUANT_CHUNK_ELEMENTS = 1 << 22


def quantize_int8_rowwise(
    weight: torch.Tensor, *, stochastic: bool = False, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``weight`` row-wise to int8 with absmax scaling (bitsandbytes layout).

    Args:
        weight: float tensor ``[m, n]`` (any float dtype; computed in fp32).
        stochastic: round stochastically (unbiased: ``E[CB] = W*127/SCB``) instead of to nearest.
        generator: RNG for stochastic rounding (on ``weight``'s device).

    Returns:
        ``(CB, SCB)``: ``CB`` int8 ``[m, n]``, ``SCB`` fp32 ``[m]`` = ``max|W[i, :]|``.
        Round-to-nearest matches ``bitsandbytes.functional.int8_vectorwise_quant`` bit for bit on
        fp16 input (same ``W * (127 / SCB)`` then round-half-to-even). All-zero rows give
        ``SCB = 0`` and ``CB = 0`` (bitsandbytes would produce NaN there).

    Raises:
        ValueError: if ``weight`` is not 2-D floating point.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"expected a 2-D float weight, got {tuple(weight.shape)} {weight.dtype}")
    m, n = weight.shape
    cb = torch.empty(m, n, dtype=torch.int8, device=weight.device)
    scb = torch.empty(m, dtype=torch.float32, device=weight.device)
    # rows at a time, so the fp32 temporaries stay at one chunk's size (rows are quantized on
    # their own: the same codes as one pass); stochastic rounding keeps one pass, its random
    # stream drawn over the whole tensor as it always was
    step = m if stochastic else max(1, QUANT_CHUNK_ELEMENTS // max(n, 1))
    for r0 in range(0, m, step):
        w = weight[r0 : r0 + step].float()
        s = w.abs().amax(dim=1)
        inv = torch.where(s > 0, 127.0 / s, torch.zeros_like(s))
        scaled = w * inv.unsqueeze(1)
        if stochastic:
            gen_device = generator.device if generator is not None else scaled.device
            noise = torch.rand(scaled.shape, generator=generator, device=gen_device)
            q = torch.floor(scaled + noise.to(scaled.device))
        else:
            q = torch.round(scaled)
        cb[r0 : r0 + step] = q.clamp_(-127, 127)
        scb[r0 : r0 + step] = s
    return cb, scb


def dequant_int8_rowwise(
    cb: torch.Tensor, scb: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize int8 row-wise weights: ``W = CB * SCB[:, None] / 127`` → ``[m, n]`` in ``dtype``.

    The product is formed in fp32 and then cast, as bitsandbytes' ``int8_vectorwise_dequant``.
    """
    return (cb * int8_row_scale(scb).unsqueeze(1)).to(dtype)  # int8 * fp32 -> fp32, one pass


def int8_row_scale(scb: torch.Tensor) -> torch.Tensor:
    """``SCB / 127`` in fp32 (``[m]``), correctly rounded on every device.

    A Python-scalar divisor would let torch's CUDA kernel multiply by the rounded reciprocal
    ``1/127`` instead, one ulp off for some ``SCB``; dividing by a tensor is IEEE division on the
    CPU and the GPU alike, so the dequantized weight is bit-identical across devices."""
    scb = scb.float()
    return scb / torch.full_like(scb, 127.0)


def int8_rowwise_matmul(x: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` with ``W = dequant(CB, SCB)``: ``x [..., n]`` → ``[..., m]`` in ``x.dtype``.

    Reference for the fused dequant-matmul kernel. The dequantized weight is a temporary that is
    freed on return; nothing but ``CB``/``SCB`` persists.
    """
    return x @ dequant_int8_rowwise(cb, scb, x.dtype).t()


def int8_rowwise_matmul_t(g: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """``g @ W`` with ``W = dequant(CB, SCB)``: ``g [..., m]`` → ``[..., n]`` (the dX GEMM)."""
    return g @ dequant_int8_rowwise(cb, scb, g.dtype)


# ----------------------------------------------------------------------------------------------
# Cayley–Neumann parameterization and block-diagonal multiply
# ----------------------------------------------------------------------------------------------


def skew_from_packed(packed: torch.Tensor, block_size: int) -> torch.Tensor:
    """Build skew-symmetric blocks ``Q = U - U.T`` from packed strict upper triangles.

    Args:
        packed: ``[nb, b(b-1)/2]`` (row-major strict upper triangle of each block).
        block_size: ``b``.

    Returns:
        ``Q``: ``[nb, b, b]`` with ``Q.transpose(-1, -2) == -Q``, same dtype/device as ``packed``.
    """
    b = block_size
    nb, npk = packed.shape
    if npk != b * (b - 1) // 2:
        raise ValueError(f"packed has {npk} entries per block; b={b} needs {b * (b - 1) // 2}")
    iu = torch.triu_indices(b, b, 1, device=packed.device)
    flat_idx = iu[0] * b + iu[1]
    u = packed.new_zeros(nb, b * b)
    u = u.index_copy(1, flat_idx, packed)  # differentiable w.r.t. packed
    u = u.view(nb, b, b)
    return u - u.transpose(1, 2)


def cayley_neumann(packed: torch.Tensor, block_size: int, terms: int = 3) -> torch.Tensor:
    """Cayley–Neumann orthogonal blocks ``G ≈ (I + Q)(I - Q)^{-1}`` from packed skew parameters.

    ``G = (I + Q)(I + Q + … + Q^k) = I + 2(Q + Q² + … + Q^k) + Q^{k+1}`` with ``k = terms``
    (POET, arXiv 2506.08001, §CNP). For ``k = 3``: ``I + 2(Q + Q² + Q³) + Q⁴``. The deviation from
    orthogonality is ``O(‖Q‖^{k+1})``; ``Q = 0`` gives ``G = I``.

    Args:
        packed: ``[nb, b(b-1)/2]`` float.
        block_size: ``b``.
        terms: Neumann order ``k ≥ 1``.

    Returns:
        ``G``: ``[nb, b, b]`` in ``packed.dtype``; differentiable.
    """
    if terms < 1:
        raise ValueError(f"Neumann terms k must be >= 1, got {terms}")
    return cnp_from_skew(skew_from_packed(packed, block_size), terms)


_EYES: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _eye(b: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.eye(b)``, built once per (b, dtype, device): the layers ask for it on every call
    and each fresh one costs two kernel launches. Not cached while a CUDA graph is being captured
    (a tensor made then holds its values only inside the graph's replays)."""
    key = (b, dtype, device)
    eye = _EYES.get(key)
    if eye is None:
        eye = torch.eye(b, dtype=dtype, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _EYES[key] = eye
    return eye


def cnp_from_skew(q: torch.Tensor, terms: int = 3) -> torch.Tensor:
    """The Cayley–Neumann polynomial of dense skew blocks ``q [nb, b, b]`` (``terms = k ≥ 1``):
    ``I + 2(Q + … + Q^k) + Q^{k+1}`` → ``[nb, b, b]`` in ``q.dtype`` (see :func:`cayley_neumann`).
    """
    eye = _eye(q.shape[-1], q.dtype, q.device)
    if terms == 3:  # I + 2Q + Q²(2I + 2Q + Q²): two batched matmuls instead of three
        q2 = q @ q
        a = torch.add(eye, q, alpha=2.0)  # I + 2Q
        return torch.baddbmm(a, q2, (a + eye).add_(q2))  # a + Q²·(2I + 2Q + Q²)
    acc = q
    power = q
    for _ in range(terms - 1):
        power = power @ q
        acc = acc + power
    power = power @ q  # Q^{k+1}
    return eye + 2.0 * acc + power


def _index_permute(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]).index_select(1, perm)
    return flat.view(*x.shape[:-1], perm.numel())


class PermuteLast(torch.autograd.Function):
    """``gather(x, perm)`` (= ``x[..., perm]``) whose backward is ``gather(dy, inv_perm)``, with
    ``inv_perm = argsort(perm)`` when ``None`` is passed. ``gather`` is this module's
    ``index_select`` (:func:`permute_last`). ``index_select``'s own
    backward is a scatter-add (``index_add_``), which on CUDA runs an atomic kernel: 315 µs per
    [8192, 5632] bf16 gradient on an H200 against ~25 µs for a gather."""

    @staticmethod
    def forward(ctx, x, perm, inv_perm, gather):  # type: ignore[override]
        ctx.save_for_backward(perm, inv_perm)
        ctx.gather = gather
        return gather(x, perm)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):  # type: ignore[override]
        perm, inv_perm = ctx.saved_tensors
        if inv_perm is None:
            inv_perm = torch.argsort(perm)
        # through apply again, so that a double backward (create_graph=True) sees a gather too
        return PermuteLast.apply(d_out, inv_perm, perm, ctx.gather), None, None, None


def permute_last(
    x: torch.Tensor, perm: torch.Tensor, inv_perm: torch.Tensor | None = None
) -> torch.Tensor:
    """``x[..., perm]`` (``x [..., d]``, ``perm [d]`` int64 permutation of ``range(d)``) via a
    2-D ``index_select``, which is several times faster than N-D indexing on the CPU.

    Differentiable w.r.t. ``x``: the backward is ``dy[..., inv_perm]`` (a gather, no
    scatter-add), with ``inv_perm = argsort(perm)`` computed when not given. ``perm`` must be a
    permutation (not checked): for repeated indices the gradient would be wrong.
    """
    if torch.is_grad_enabled() and x.requires_grad:
        return PermuteLast.apply(x, perm, inv_perm, _index_permute)
    return _index_permute(x, perm)


def block_diag_matmul(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Block-diagonal multiply ``x @ BD(G).T``.

    Args:
        x: ``[..., nb*b]``.
        g: ``[nb, b, b]``.

    Returns:
        ``[..., nb*b]`` where block ``i`` is ``x_i @ G[i].T`` (never builds the dense matrix).
    """
    nb, b, _ = g.shape
    lead = x.shape[:-1]
    xb = x.reshape(-1, nb, b)
    out = torch.einsum("tkc,kdc->tkd", xb, g)
    return out.reshape(*lead, nb * b)
