"""Low-bit GEMM and orthogonal-block kernels for POET-XQ.

The functions exported here are the single entry points the POET-X(Q) layer calls. Each picks, per
call, the fastest *measured* correct path; the plain-torch references
(:mod:`quant_kernels.reference`, :mod:`quant_kernels.reference_4bit`) run on the CPU and remain
the test oracle.

Dispatch on CUDA, from the H200 timings in ``evals/results/gpu_suite_streamed_h200.json``
(ratios to bf16 cuBLAS at the Llama-8B/13B MLP shapes):

* int8 GEMMs (forward ``x @ Wᵀ`` and dX ``g @ W``) with at least :data:`STREAMED_MIN_M` token
  rows, and every 4-bit GEMM: the slab-streamed path (:mod:`quant_kernels.streamed`): one
  memory-bound Triton kernel decodes a bounded band of the weight into a reusable 16-bit slab and
  cuBLAS multiplies it; the weight never exists in 16 bits beyond one slab
  (:func:`slab_bytes_for`). int8 at 8,192 tokens: 1.10–1.22× forward, 1.06–1.20× dX, against
  1.29–1.69× / 1.90–1.94× for the fused kernel and 1.24–1.35× / 1.13–1.26× for dequantizing the
  whole weight first. NF4: 1.08–1.28× forward, 1.24–1.40× dX (bitsandbytes' own
  dequantize-then-matmul: 1.03–1.14×, holding the whole bf16 weight); the fused NF4 kernels
  measured 22–72×.
* int8 with fewer rows: the fused Triton kernels (:mod:`quant_kernels.dequant_matmul`), which read
  the int8 weight once per M-tile and never decode a slab.

* Cayley–Neumann blocks (:func:`cayley_neumann`, :func:`cayley_neumann_lean`): for bf16 ``Q``
  the fused CNP (``k = 3``) in its ``hybrid`` layout (:data:`HYBRID_CNP_MEASURED_FASTER`):
  Triton for ``Q``, ``Q²`` and the elementwise terms, cuBLAS for the full products
  (:mod:`quant_kernels.cnp_hybrid`), which ``evals/bench_cnp.py`` timed faster than the torch
  paths and the all-Triton packed kernels of :mod:`quant_kernels.cnp_triton`
  (:data:`FUSED_CNP_BF16_MEASURED_FASTER`), and for fp32 ``Q`` too, where its cuBLAS products
  beat the torch reference (:data:`FUSED_CNP_MEASURED_FASTER`).

``POETXQ_KERNELS=fused`` / ``streamed`` / ``torch`` force one path everywhere on CUDA (``torch``:
the plain references, which dequantize the whole weight at once). This package imports only torch
(Triton lazily, on first use).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quant_kernels import cnp, reference
from quant_kernels._policy import HAS_TRITON as _HAS_TRITON
from quant_kernels._policy import KERNEL_MODES, kernel_mode, opt_in_kernel, triton_enabled
from quant_kernels.block_diag import block_diag_grad, block_diag_matmul
from quant_kernels.cnp import skew_from_packed
from quant_kernels.reference import dequant_int8_rowwise, quantize_int8_rowwise

__all__ = [
    "KERNEL_MODES",
    "block_diag_grad",
    "block_diag_matmul",
    "blockwise_4bit_backward_fm",
    "blockwise_4bit_matmul",
    "blockwise_4bit_matmul_fm",
    "blockwise_4bit_matmul_t",
    "blockwise_4bit_matmul_t_fm",
    "cayley_neumann",
    "cayley_neumann_lean",
    "dequant_int8_rowwise",
    "feature_major_layer",
    "fused_input_cast",
    "int8_rowwise_backward_fm",
    "int8_rowwise_matmul",
    "int8_rowwise_matmul_fm",
    "int8_rowwise_matmul_t",
    "int8_rowwise_matmul_t_fm",
    "kernel_mode",
    "lean_fast_swiglu",
    "permute_to_feature_major",
    "permute_to_row_major",
    "quantize_int8_rowwise",
    "skew_from_packed",
    "slab_bytes_for",
    "triton_enabled",
    "weight_gemm_path",
]

#: token rows from which the int8 GEMMs take the slab-streamed path (module docstring)
STREAMED_MIN_M = 512


def slab_bytes_for(rows: int) -> int:
    """Decoded-slab size for a weight GEMM with ``rows`` token rows (bytes).

    Measured on the H200 at the 8B/13B MLP shapes: 64 MiB slabs win at 2,048 tokens (int8 forward
    1.33–1.40× vs 1.42–1.55× with 32 MiB), 32 and 64 MiB tie at 8,192 tokens; 32 MiB is taken
    there to keep the transient smaller. Both stay below the 112–135 MiB bf16 weight.
    """
    return (64 if rows <= 4096 else 32) * 2**20


#: whether ``POETXQ_KERNELS=auto`` picks the fused CNP (k = 3) on CUDA for fp32 ``Q``
#: (``poetxq train`` keeps fp32 parameters). True since the ``hybrid`` layout: forward+backward
#: over the Llama-8B blocks at b = 256 in 56.1 ms against 80.0 ms for the torch reference
#: (``evals/results/cnp_hybrid_h200.json``; fp32 products without tf32 in both). The all-Triton
#: ``packed`` layout is 2.0× slower than the reference in fp32 (``cnp_h200.json``).
FUSED_CNP_MEASURED_FASTER = True
#: the same for bf16 and fp16 ``Q`` (bf16 parameters, as ``evals/gpu_memory.py`` and the layer
#: benchmark hold them). True: forward+backward over the Llama-8B blocks 11.7 ms (``hybrid``)
#: and 20.6 ms (``packed``) against 27.3 ms for the recomputing torch path the layers use
#: otherwise and 29.0 ms for the reference under plain autograd
#: (``evals/results/cnp_hybrid_h200.json``).
FUSED_CNP_BF16_MEASURED_FASTER = True
_FUSED_CNP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: whether the POET-X(Q) ``mem`` layers run feature-major between their two permutations
#: (:mod:`quant_kernels.transpose_perm`, ``FrozenWeight.matmul_fm``) on CUDA under ``auto``
#: (non-ragged sides, int8 and 16-bit stores). True: the layer's GPU time at the 8B MLP shapes
#: falls 19–22 % (``evals/results/layer_overhead_h200.json``) and whole Llama-8B/13B steps at
#: batch 1 × 2048 are 4–31 % faster in all eight settings (``feature_major_ab_h200.json``). An
#: earlier eager-only timing (``gpu_suite_feature_major_h200.json``) could not see it: the lone
#: layer's wall time is the host's.
FEATURE_MAJOR_LAYER_MEASURED_FASTER = True


#: whether the int8 ``mem`` backward (feature-major) decodes its weight once for both of its
#: GEMMs (:func:`int8_rowwise_backward_fm`, :func:`quant_kernels.streamed.streamed_backward_fm`)
#: on the slab-streamed path under ``auto``. True: the layer's GPU time at the 8B MLP shapes
#: falls 2.7 % / 1.0 % (``evals/results/layer_one_decode_h200.json``), and dX stays within 2.2e-6
#: of the float64 oracle in fp32 (4.5e-3 under bf16 autocast, against 4.1e-3 with two decodes:
#: its bands are summed in bf16).
ONE_DECODE_BACKWARD_MEASURED_FASTER = True


#: The ``fast`` variant's training forward feature-major too (``poetxq.layer_fm._POETXFastFmFn``):
#: the same permute-transposes and ``bmm``s as the measured ``mem`` path in place of the
#: autograd path's ``index_select`` gathers (4–5× their HBM floor against 1.8–3.3×,
#: ``evals/results/bench_gather_h200.json``). True since it was timed both ways on the H200
#: (``evals/results/fast_feature_major_h200.json``, ac87b34): the layer's GPU time at the 8B MLP
#: shapes fell from 1.40 / 1.38 to 1.07 / 1.09 ms (int8) and from 1.28 / 1.30 to 0.97 / 0.97 ms
#: (bf16), and a Llama-1B POET-X step at 8,192 tokens from 0.234 to 0.184 s eager (0.214 to
#: 0.181 s in a CUDA graph). Non-Triton dtypes, ragged sides and the 4-bit input-order store
#: keep the autograd path.
FAST_FEATURE_MAJOR_MEASURED_FASTER = True


def fast_feature_major_layer(x: torch.Tensor) -> bool:
    """Whether a ``fast`` POET-X(Q) layer's training forward may take the feature-major path for
    ``x``: a CUDA tensor of a Triton dtype, Triton enabled, and
    :data:`FAST_FEATURE_MAJOR_MEASURED_FASTER` (on) or ``POETXQ_KERNELS=fused``."""
    return x.dtype in _FUSED_CNP_DTYPES and opt_in_kernel(x, FAST_FEATURE_MAJOR_MEASURED_FASTER)


#: whether a POET-X(Q) layer on the feature-major path takes an input of another dtype than its
#: compute dtype (fp32 activations under bf16 autocast: the norm outputs that feed q/k/v and
#: gate/up) as it is, casting it inside the permute-transpose that reads it anyway
#: (``out_dtype``), and returns ``dx`` in the input's dtype from the permute-transpose that
#: writes it. Removes one cast pass forward and one backward per such projection (~240 casts of
#: [8192, 2048] per Llama-1B step, part of the ~20 ms of ``copy_`` in
#: ``profiles/profile_1b_256_poetxq_fast_ac87b34.txt``); the values are the same (the cast
#: rounds as ``.to()`` does). The ``mem`` variant then keeps the shared fp32 input instead of a
#: 16-bit copy per projection (q/k/v: 4 bytes per element in all instead of 3 × 2; the
#: estimator books the difference, ``poetxq.estimate``). Measured in one call on the H200
#: (``evals/results/opt_in_ab_h200_d8a3ac2.json``): Llama-1B / 3B at 8,192 tokens in a CUDA
#: graph, +2.8–3.5 % tokens/s for the ``fast`` variant and +1.8–2.4 % for ``mem`` at seq 256
#: and 1024, 0.34–0.84 GiB less reserved for ``mem``; on since.
FUSED_INPUT_CAST_MEASURED_FASTER = True


#: whether a ``fast`` feature-major down projection under SwiGLU keeps only ``gate``, ``up`` and
#: its GEMM output (``poetxq.layer_fm._SwiGLUDownFastFmFn``), recomputing the product and its
#: permuted copy in backward, instead of the autograd composition that also keeps ``SiLU(gate)``
#: and the permuted input: ``2·f`` fewer saved elements per token and layer (Llama-1B at 8,192
#: tokens: 4.4 GB, the estimate 35.3 → 31.2 GiB against 34.5 GiB measured). The bytes moved are
#: about the same (the recompute replaces the composition's separate SiLU-backward and product
#: passes; with ``train.fuse_elementwise`` the maps are compiled as for ``mem``). Measured
#: (``evals/results/opt_in_ab_h200_d8a3ac2.json``, CUDA graph, 8,192 tokens): tokens/s within
#: +0.1–0.8 % of the composition at Llama-1B / 3B, seq 256 / 1024, and the reserved peak 37.9 →
#: 34.3 GiB (1B) and 61.3 → 55.2 GiB (3B); on since.
LEAN_FAST_SWIGLU_MEASURED_FASTER = True


#: whether the flattened 8-bit AdamW step (``poetxq.optim.adamw8bit_class``) runs on a CUDA
#: device through :func:`quant_kernels.adam8bit.adam8bit_update` (Triton: bitsandbytes' update
#: rule and state format, its nearest-code search replaced by a table lookup; bit-identical to
#: bitsandbytes' own Triton kernel of the update) instead of bitsandbytes' CUDA op. The CUDA op
#: took 24.4 ms of a 402 ms Llama-13B graph step (~14x its memory floor;
#: ``evals/results/profiles/profile_llama-13b_no_ckpt_graph_h200_e1e525d.txt``) and bitsandbytes'
#: Triton kernel 1.9x less (``bench_optim8bit_h200_bea4de0.json``), ours 3.1x less: 7.0 against
#: 11.5 and 22.1 ms for 0.83 G bf16 parameters (2.8x in fp32: 8.1 against 22.5 ms),
#: bit-identical to bitsandbytes' Triton kernel on the H200
#: (``bench_optim8bit_h200_ef47a77.json``). Whole 13B graph steps at batch 1 x 2048:
#: 0.398 s with the CUDA op, 0.384 s with ours (``optim8bit_13b_{off,ours}_h200_ef47a77.json``;
#: 0.388 s with bitsandbytes' Triton kernel in an earlier call, ``optim8bit_*_h200_2e10d2e.json``).
#: The Triton kernels differ from the CUDA op at rounding level (after 5 steps 0.001 % / 0.1 % of
#: the state codes in fp32 / bf16).
TRITON_8BIT_UPDATE_MEASURED_FASTER = True


def triton_8bit_update(t: torch.Tensor) -> bool:
    """Whether the 8-bit AdamW update of ``t`` runs :func:`quant_kernels.adam8bit.adam8bit_update`
    (see :data:`TRITON_8BIT_UPDATE_MEASURED_FASTER`): a CUDA tensor, Triton installed, and the
    flag or ``POETXQ_KERNELS=fused``."""
    return opt_in_kernel(t, TRITON_8BIT_UPDATE_MEASURED_FASTER)


def lean_fast_swiglu(x: torch.Tensor) -> bool:
    """Whether a ``fast`` down projection takes the lean SwiGLU path for its input ``x`` (see
    :data:`LEAN_FAST_SWIGLU_MEASURED_FASTER`): a Triton dtype, and the flag or
    ``POETXQ_KERNELS=fused``; the layer also needs its feature-major path."""
    return x.dtype in _FUSED_CNP_DTYPES and opt_in_kernel(x, LEAN_FAST_SWIGLU_MEASURED_FASTER)


def fused_input_cast(x: torch.Tensor, compute_dtype: torch.dtype) -> bool:
    """Whether a feature-major POET-X(Q) layer takes ``x`` uncast (see
    :data:`FUSED_INPUT_CAST_MEASURED_FASTER`): ``x`` is not yet in ``compute_dtype``, both are
    Triton dtypes, and the flag or ``POETXQ_KERNELS=fused``."""
    return (
        x.dtype != compute_dtype
        and x.dtype in _FUSED_CNP_DTYPES
        and compute_dtype in _FUSED_CNP_DTYPES
        and opt_in_kernel(x, FUSED_INPUT_CAST_MEASURED_FASTER)
    )


def feature_major_layer(x: torch.Tensor) -> bool:
    """Whether a POET-X(Q) ``mem`` layer may take the feature-major path for ``x``: a Triton
    dtype, and :data:`FEATURE_MAJOR_LAYER_MEASURED_FASTER` or ``POETXQ_KERNELS=fused``."""
    return x.dtype in _FUSED_CNP_DTYPES and opt_in_kernel(x, FEATURE_MAJOR_LAYER_MEASURED_FASTER)


def permute_to_feature_major(
    x: torch.Tensor, inv_perm: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """:func:`quant_kernels.transpose_perm.permute_to_feature_major` (imported on first use)."""
    from quant_kernels import transpose_perm

    return transpose_perm.permute_to_feature_major(x, inv_perm, out_dtype=out_dtype)


def permute_to_row_major(
    xt: torch.Tensor, perm: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """:func:`quant_kernels.transpose_perm.permute_to_row_major` (imported on first use)."""
    from quant_kernels import transpose_perm

    return transpose_perm.permute_to_row_major(xt, perm, out_dtype=out_dtype)


def _rows(t: torch.Tensor) -> int:
    return t.numel() // max(t.shape[-1], 1)


def weight_gemm_path(act: torch.Tensor, *, bits: int = 8) -> str:
    """Which path serves a weight GEMM whose activation operand is ``act`` (``bits`` of the
    stored weight: 8 or 4).

    Returns ``"torch"`` (CPU tensors, no Triton, or ``POETXQ_KERNELS=torch``), ``"fused"`` or
    ``"streamed"`` (see the module docstring).

    Raises:
        ValueError: ``POETXQ_KERNELS`` holds an unknown mode.
    """
    mode = kernel_mode()
    if not (act.is_cuda and _HAS_TRITON) or mode == "torch":
        return "torch"
    if bits == 4 or mode == "streamed":
        return "streamed"  # the only Triton path of a 4-bit weight
    if mode == "fused":
        return mode
    return "streamed" if _rows(act) >= STREAMED_MIN_M else "fused"


def int8_rowwise_matmul(x: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """``x @ Wᵀ`` with ``W = CB · SCB/127`` (``x [..., K]``, ``CB`` int8 ``[N, K]``) → ``[..., N]``.

    Dispatch: see the module docstring.
    """
    path = weight_gemm_path(x)
    if path == "streamed":
        from quant_kernels.streamed import int8_decoder, streamed_matmul_nt

        return streamed_matmul_nt(
            x, int8_decoder(cb, scb), *cb.shape, slab_bytes=slab_bytes_for(_rows(x))
        )
    if path == "fused":
        from quant_kernels.dequant_matmul import int8_matmul

        return int8_matmul(x, cb, scb)
    return reference.int8_rowwise_matmul(x, cb, scb)


def int8_rowwise_matmul_t(g: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """``g @ W`` with ``W = CB · SCB/127`` (``g [..., N]``) → ``[..., K]`` (the dX GEMM)."""
    path = weight_gemm_path(g)
    if path == "streamed":
        from quant_kernels.streamed import int8_decoder, streamed_matmul_nn

        return streamed_matmul_nn(
            g, int8_decoder(cb, scb), *cb.shape, slab_bytes=slab_bytes_for(_rows(g))
        )
    if path == "fused":
        from quant_kernels.dequant_matmul import int8_matmul_t

        return int8_matmul_t(g, cb, scb)
    return reference.int8_rowwise_matmul_t(g, cb, scb)


def int8_rowwise_matmul_fm(zt: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """``W @ zt`` = ``(z @ Wᵀ)ᵀ`` for a feature-major activation ``zt [K, T]`` → ``[N, T]``
    contiguous (``W = CB · SCB/127``, ``CB [N, K]``): the forward GEMM of a layer that keeps its
    activations feature-major (``evals/notes/streamed_and_layer.md``). Streamed on a GPU;
    elsewhere the reference, or the row-major kernel and a transpose."""
    path = weight_gemm_path(zt.t())
    if path == "streamed":
        from quant_kernels.streamed import int8_decoder, streamed_matmul_fm

        return streamed_matmul_fm(
            zt, int8_decoder(cb, scb), *cb.shape, slab_bytes=slab_bytes_for(zt.shape[1])
        )
    if path == "fused":
        return int8_rowwise_matmul(zt.t(), cb, scb).t().contiguous()
    return reference.dequant_int8_rowwise(cb, scb, zt.dtype) @ zt


def int8_rowwise_matmul_t_fm(
    dht: torch.Tensor, cb: torch.Tensor, scb: torch.Tensor
) -> torch.Tensor:
    """``Wᵀ @ dht`` = ``(dh @ W)ᵀ`` for ``dht [N, T]`` → ``[K, T]`` contiguous: the dX GEMM,
    feature-major (see :func:`int8_rowwise_matmul_fm`)."""
    path = weight_gemm_path(dht.t())
    if path == "streamed":
        from quant_kernels.streamed import int8_decoder, streamed_matmul_t_fm

        return streamed_matmul_t_fm(
            dht, int8_decoder(cb, scb), *cb.shape, slab_bytes=slab_bytes_for(dht.shape[1])
        )
    if path == "fused":
        return int8_rowwise_matmul_t(dht.t(), cb, scb).t().contiguous()
    return reference.dequant_int8_rowwise(cb, scb, dht.dtype).t() @ dht


def int8_rowwise_backward_fm(
    zt: torch.Tensor,
    dht: torch.Tensor,
    cb: torch.Tensor,
    scb: torch.Tensor,
    row_align: int,
    on_rows: Callable[[int, torch.Tensor], None],
) -> torch.Tensor:
    """The two weight GEMMs of a feature-major ``mem`` backward with ``W = CB · SCB/127``
    (``CB [N, K]``): the recompute ``W @ zt`` (``zt [K, T]``), handed to ``on_rows(row0, rows)``
    in bands of whole ``row_align``-row groups (possibly one band of all ``N`` rows), and the
    returned dX GEMM ``Wᵀ @ dht`` (``dht [N, T]``) → ``[K, T]`` contiguous.

    On the slab-streamed path with :data:`ONE_DECODE_BACKWARD_MEASURED_FASTER`, one decode of
    each slab serves both (:func:`quant_kernels.streamed.streamed_backward_fm`); otherwise
    :func:`int8_rowwise_matmul_fm` then :func:`int8_rowwise_matmul_t_fm`.
    """
    if ONE_DECODE_BACKWARD_MEASURED_FASTER and weight_gemm_path(zt.t()) == "streamed":
        from quant_kernels.streamed import int8_decoder, streamed_backward_fm

        return streamed_backward_fm(
            zt, dht, int8_decoder(cb, scb), *cb.shape, row_align=row_align, on_rows=on_rows,
            slab_bytes=slab_bytes_for(zt.shape[1]),
        )  # fmt: skip
    on_rows(0, int8_rowwise_matmul_fm(zt, cb, scb))
    return int8_rowwise_matmul_t_fm(dht, cb, scb)


def _fourbit_decoder(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
    device: torch.device,
) -> Callable[..., torch.Tensor]:
    """The slab decoder of a bitsandbytes NF4/FP4 weight ``[N, K]`` (``absmax`` fp32)."""
    from quant_kernels import reference_4bit
    from quant_kernels.streamed import fourbit_decoder

    code = reference_4bit.get_4bit_code(quant_type, device)
    return fourbit_decoder(packed, absmax, code, blocksize, shape[1])


def blockwise_4bit_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
) -> torch.Tensor:
    """``x @ Wᵀ`` for a bitsandbytes NF4/FP4 blockwise weight ``W [N, K]`` → ``[..., N]``.

    ``absmax`` is fp32 (double-quantized statistics dequantized first). Dispatch: see the module
    docstring.
    """
    from quant_kernels import reference_4bit

    path = weight_gemm_path(x, bits=4)
    if path == "streamed":
        from quant_kernels.streamed import streamed_matmul_nt

        dec = _fourbit_decoder(packed, absmax, quant_type, blocksize, shape, x.device)
        return streamed_matmul_nt(x, dec, *shape, slab_bytes=slab_bytes_for(_rows(x)))
    return reference_4bit.blockwise_4bit_matmul(x, packed, absmax, quant_type, blocksize, shape)


def blockwise_4bit_matmul_t(
    g: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
) -> torch.Tensor:
    """``g @ W`` for a bitsandbytes NF4/FP4 weight ``W [N, K]`` (``g [..., N]``) → ``[..., K]``."""
    from quant_kernels import reference_4bit

    path = weight_gemm_path(g, bits=4)
    if path == "streamed":
        from quant_kernels.streamed import streamed_matmul_nn

        dec = _fourbit_decoder(packed, absmax, quant_type, blocksize, shape, g.device)
        return streamed_matmul_nn(g, dec, *shape, slab_bytes=slab_bytes_for(_rows(g)))
    return reference_4bit.blockwise_4bit_matmul_t(g, packed, absmax, quant_type, blocksize, shape)


def _blockwise_4bit_fm(
    a: torch.Tensor,
    weight_t: bool,
    args: tuple[torch.Tensor, torch.Tensor, str, int, tuple[int, int]],
) -> torch.Tensor:
    """``W @ a`` (``a [K, T]``) or, with ``weight_t``, ``Wᵀ @ a`` (``a [N, T]``) for the 4-bit
    weight ``args = (packed, absmax, quant_type, blocksize, (N, K))``, feature-major out."""
    packed, absmax, quant_type, blocksize, shape = args
    if weight_gemm_path(a.t(), bits=4) == "streamed":
        from quant_kernels import streamed

        run = streamed.streamed_matmul_t_fm if weight_t else streamed.streamed_matmul_fm
        dec = _fourbit_decoder(packed, absmax, quant_type, blocksize, shape, a.device)
        return run(a, dec, *shape, slab_bytes=slab_bytes_for(a.shape[1]))
    row_major = blockwise_4bit_matmul_t if weight_t else blockwise_4bit_matmul
    return row_major(a.t(), *args).t().contiguous()


def blockwise_4bit_matmul_fm(
    zt: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
) -> torch.Tensor:
    """``W @ zt`` for a feature-major ``zt [K, T]`` and an NF4/FP4 weight ``W [N, K]`` →
    ``[N, T]`` contiguous (:func:`int8_rowwise_matmul_fm`'s 4-bit twin). Streamed on a GPU;
    elsewhere :func:`blockwise_4bit_matmul` and a transpose copy."""
    return _blockwise_4bit_fm(zt, False, (packed, absmax, quant_type, blocksize, shape))


def blockwise_4bit_matmul_t_fm(
    dht: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
) -> torch.Tensor:
    """``Wᵀ @ dht`` for ``dht [N, T]`` → ``[K, T]`` contiguous: the 4-bit dX GEMM,
    feature-major (see :func:`blockwise_4bit_matmul_fm`)."""
    return _blockwise_4bit_fm(dht, True, (packed, absmax, quant_type, blocksize, shape))


def blockwise_4bit_backward_fm(
    zt: torch.Tensor,
    dht: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_type: str,
    blocksize: int,
    shape: tuple[int, int],
    row_align: int,
    on_rows: Callable[[int, torch.Tensor], None],
) -> torch.Tensor:
    """:func:`int8_rowwise_backward_fm` for an NF4/FP4 weight ``W [N, K]``: the recompute
    ``W @ zt`` handed to ``on_rows`` in bands of whole ``row_align``-row groups, and the
    returned dX GEMM ``Wᵀ @ dht`` → ``[K, T]``; one decode of each slab for both on the streamed
    path with :data:`ONE_DECODE_BACKWARD_MEASURED_FASTER`."""
    args = (packed, absmax, quant_type, blocksize, shape)
    if ONE_DECODE_BACKWARD_MEASURED_FASTER and weight_gemm_path(zt.t(), bits=4) == "streamed":
        from quant_kernels.streamed import streamed_backward_fm

        return streamed_backward_fm(
            zt, dht, _fourbit_decoder(*args, zt.device), *shape, row_align=row_align,
            on_rows=on_rows, slab_bytes=slab_bytes_for(zt.shape[1]),
        )  # fmt: skip
    on_rows(0, blockwise_4bit_matmul_fm(zt, *args))
    return blockwise_4bit_matmul_t_fm(dht, *args)


def permute_last(
    x: torch.Tensor, perm: torch.Tensor, inv_perm: torch.Tensor | None = None
) -> torch.Tensor:
    """``x[..., perm]`` for ``x [..., d]`` and a permutation ``perm [d]`` (int64, ``x``'s device):
    :func:`quant_kernels.reference.permute_last` (torch ``index_select``, whose backward gathers
    by ``inv_perm``). Differentiable w.r.t. ``x``.
    """
    return reference.permute_last(x, perm, inv_perm)


def _fused_cnp(packed: torch.Tensor, terms: int) -> bool:
    """Whether the fused CNP serves this call: CUDA, Triton, ``k = 3``, fp32/bf16/fp16, and
    either the measured flag of the dtype (:data:`FUSED_CNP_BF16_MEASURED_FASTER` for bf16 and
    fp16, which run the same tensor-core kernels; :data:`FUSED_CNP_MEASURED_FASTER` for fp32) or
    ``POETXQ_KERNELS=fused`` (never with ``torch``)."""
    fp32 = packed.dtype == torch.float32
    measured = FUSED_CNP_MEASURED_FASTER if fp32 else FUSED_CNP_BF16_MEASURED_FASTER
    return terms == 3 and packed.dtype in _FUSED_CNP_DTYPES and opt_in_kernel(packed, measured)


def _autocast_input(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` in the dtype the torch reference's products would run in: under autocast on
    its device, fp32 ``packed`` cast to the autocast dtype (autocast runs the reference's
    ``bmm`` in bf16 and returns bf16 ``G``; the fused kernels, which autocast does not see, get
    that dtype this way, their elementwise terms in it too); otherwise ``packed`` itself."""
    dev = packed.device.type
    if packed.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        return packed.to(torch.get_autocast_dtype(dev))
    return packed


def cayley_neumann(packed: torch.Tensor, block_size: int, terms: int = 3) -> torch.Tensor:
    """Cayley–Neumann blocks ``G [nb, b, b]`` from packed skew parameters ``[nb, b(b-1)/2]``
    (:func:`quant_kernels.reference.cayley_neumann`: same arguments, result and errors).

    Dispatch: the fused kernels (:mod:`quant_kernels.cnp_triton`, in the ``hybrid`` layout when
    :data:`HYBRID_CNP_MEASURED_FASTER`) when :func:`_fused_cnp` allows — under autocast on fp32
    ``packed`` in the autocast dtype, as the reference computes there
    (:func:`_autocast_input`); otherwise the torch reference under plain autograd.
    """
    x = _autocast_input(packed)
    if _fused_cnp(x, terms):
        from quant_kernels.cnp_hybrid import cayley_neumann_fused

        return cayley_neumann_fused(x, block_size, terms)
    return cnp.cayley_neumann(packed, block_size, terms)


def cayley_neumann_lean(packed: torch.Tensor, block_size: int, terms: int = 3) -> torch.Tensor:
    """:func:`cayley_neumann` that saves only ``packed`` for backward
    (:func:`quant_kernels.cnp.cayley_neumann_lean`; the fused kernels save only ``packed`` too).
    """
    x = _autocast_input(packed)
    if _fused_cnp(x, terms):
        from quant_kernels.cnp_hybrid import cayley_neumann_fused

        return cayley_neumann_fused(x, block_size, terms)
    return cnp.cayley_neumann_lean(packed, block_size, terms)
