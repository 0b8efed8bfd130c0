"""Analytic GPU-memory estimate of one training step of a recipe, before launching it.

Everything is counted in bytes from the recipe's shapes; nothing is allocated. The breakdown:

* **frozen / quantized weights** — POET-X(Q) stores (:mod:`poetxq.model.quant`): int8 row-wise
  ``m·n`` codes + ``4·m`` bytes ``SCB`` + 1 byte ``weight_format``; NF4/FP4 ``⌈m·n/2⌉`` packed
  codes + 64 B code book + absmax (double quant: 1 byte per 64-block, fp32 per 256 of those, a
  256-entry fp32 nested code and a 4-byte offset; else fp32 per 64-block); unquantized POET-X
  ``m·n`` in the parameter dtype. Q-GaLore / Q-APOLLO: ``m·n`` uint8 codes + fp32 scale and zero per
  group. Plus the POET permutations (int64 ``perm`` and ``inv_perm`` per side) and ragged masks.
* **trainable parameters** — POET: packed skew ``Q`` ``[⌈d/b⌉, b(b−1)/2]`` per side; every
  method: embeddings, ``lm_head``, norms, and the projections that are not frozen.
* **gradients** — one per trainable parameter in its dtype; Q-GaLore / Q-APOLLO keep an fp32
  ``[m, n]`` gradient per int8 weight (``QuantLinear.float_grad``).
* **optimizer states** — torch AdamW: two moments in the parameter dtype (+ a 4-byte step);
  :class:`~poetxq.baselines.lowrank.LowRankAdamW`: fp32 moments for AdamW groups; low-rank moments
  ``[m, r]`` or ``[r, n]`` (fp32, or 8-bit blockwise codes + fp32 absmax per 256 for Q-GaLore),
  the projector (fp32, or INT4 packed + fp32 scale/zero per group), Q-GaLore's lazy first singular
  vector, APOLLO's previous norm.
* **activations** — tensors autograd saves in the forward pass, per token and decoder layer
  (``d`` hidden, ``f`` intermediate, ``h`` heads, ``c`` compute-dtype bytes)::

      bf16 (pure):   24d + 8f + 8 + 4h        autocast (fp32 params): 34d + 8f + 8 + 4h
      fp32:          40d + 16f + 8 + 4h

  (RMSNorms keep an fp32 input and the normalized rows; attention keeps q, k, v, the output and
  the log-sum-exp; the MLP keeps gate, up, SiLU(gate) and their product — with POET ``mem`` layers
  only gate and up, :class:`poetxq.model.layer.POETXSwiGLUMLP`, so ``4f`` less, ``8f`` in fp32; with
  ``train.fuse_elementwise`` active, :mod:`poetxq.model.fuse`, a compiled RMSNorm keeps its input
  and a per-row scale only, ``8d`` less per layer and ``4d`` less for the final norm.) POET
  ``mem`` layers keep only their input, the same tensor a ``nn.Linear`` keeps — on a GPU under
  autocast the fp32 input that q/k/v (and gate/up) share, not a bf16 copy each
  (kernel policy ``fused_input_cast``: ``2d`` less); ``fast`` also keeps
  the permuted input and the GEMM output, ``c·(n_pad + m_pad)`` per layer, but not the input
  (and with the policy's ``lean_fast_swiglu`` neither ``SiLU(gate)`` nor the down
  projection's permuted input: ``2c·f`` less). Each
  POET side adds its blocks ``G`` in the compute dtype, ``⌈d/b⌉·b²·c`` bytes; the Cayley–Neumann
  map keeps no intermediates (its backward recomputes them), only its packed input: once for the
  whole model, the concatenated ``Q`` of every side (:mod:`poetxq.model.blockcache`); under
  checkpointing, the recomputed layer's concatenated ``Q`` — neither with 8-bit states when
  every side's ``Q`` fills whole 256-element blocks and none is ragged, where the optimizer's
  flat groups (:mod:`poetxq.model.flat`) let the map read ``Q`` through a view. Under autocast,
  ``nn.Linear`` weights are also kept as bf16 copies. With whole-layer checkpointing a layer
  keeps only its input (``r·d`` per token, ``r`` the residual-stream dtype bytes) and one layer
  at a time is recomputed.
* **logits / loss** — ``[T, V]``: in the forward the bf16 logits, their fp32 copy and the
  log-softmax output; in the loss backward the log-softmax output, its gradient and the logits'
  gradient (``12·T·V`` bytes, the larger).
* **workspace** — transients of the largest layer: a dequantized weight (low-bit stores on the
  GEMM path) and ~4 ``[T, max(m, n)]`` buffers of the POET ``mem`` backward or optimizer
  temporaries.

Peak = frozen + buffers + parameters + optimizer states + the largest of: the start of backward
(activations + logits + workspace + ``lm_head`` gradient), its end (all gradients + one layer's
activations + workspace) and the optimizer step (all gradients + the optimizer's temporaries).
In a CUDA graph (``train.cuda_graph`` on a GPU) every gradient is a static tensor made before the
capture, so the start of backward holds all gradients, not only ``lm_head``'s; with
``train.optimizer_in_backward`` the update is captured inside the backward
(:mod:`poetxq.training.graph_optim`) and the gradients are booked as in an eager run with it.
The memory options of :mod:`poetxq.training.lowmem` and :mod:`poetxq.training.loss` change three
terms: ``train.offload_activations`` moves the checkpointed layer inputs to host memory
(``host_offloaded``), ``train.optimizer_in_backward`` leaves at most one decoder layer's gradients
alive (and no separate step), ``train.loss_chunk_tokens`` holds one chunk's logits instead of
``T``'s.
Checked against real byte counts of built models and optimizers and against autograd's saved
tensors in ``tests/test_estimate.py``.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from poetxq.model.flat import BNB_STATE_BLOCK
from poetxq.model.fuse import fuse_wanted
from poetxq.training.cudagraph import graph_wanted
from poetxq.training.loss import SLICE_BYTES
from poetxq.training.recipe import POET_METHODS, Recipe, method_label
from quant_kernels.policy import KernelPolicy, default_policy

#  how a run holds its parameters and computes, named as
# :data:`poetxq.training.precision.RunPrecision`
#: (``train.precision: auto`` runs ``autocast`` on a GPU and ``fp32`` on the CPU; ``bf16-true``
#: is every parameter in bf16 without autocast)
Precision = Literal["autocast", "bf16-true", "fp32"]
PRECISIONS: tuple[Precision, ...] = ("autocast", "bf16-true", "fp32")
STATE_BLOCK = 256  # bitsandbytes' block for 8-bit optimizer states
NF4_BLOCK = 64
NESTED_BLOCK = 256


class EstimateError(ValueError):
    """Bad estimator input (unknown precision, unparsable memory size)."""


@dataclass
class MemoryEstimate:
    """Byte counts of one training step (module docstring); ``peak`` is the predicted maximum of
    ``torch.cuda.max_memory_allocated`` over a steady-state step."""

    recipe: str
    method: str
    precision: str
    batch_size: int
    seq_len: int
    vocab_size: int
    gradient_checkpointing: bool
    frozen_weights: int
    buffers: int
    trainable_params: int
    gradients: int
    optimizer_states: int
    activations: int
    logits: int
    workspace: int
    optimizer_transient: int
    lm_head_grad: int
    num_trainable: int
    num_frozen: int
    layer_activations: int = 0  # saved by one decoder layer (no checkpointing)
    head_activations: int = 0  # embeddings, rotary tables, final norm, lm_head input
    #: train.optimizer_in_backward: each gradient is freed right after its update
    optimizer_in_backward: bool = False
    #: gradients alive at once with the optimizer in backward: one decoder layer's under
    #: checkpointing; without it, POET's Q gradients of every layer (one batched CNP node)
    in_backward_gradients: int = 0
    #: torch AdamW's temporary while it updates the largest parameter alone (bitsandbytes'
    #: 8-bit update is in place: 0)
    in_backward_transient: int = 0
    #: train.offload_activations: the checkpointed layer inputs, in pinned host memory
    host_offloaded: int = 0
    loss_chunk_tokens: int = 0  # train.loss_chunk_tokens (0: whole logits)
    #: train.cuda_graph on a GPU: the gradients are static tensors made before the capture
    #: (poetxq.training.cudagraph.GraphedMicroStep), so all of them exist from the start of backward
    #: (unless optimizer_in_backward: then the update is inside the captured backward)
    cuda_graph: bool = False
    peak: int = 0
    #: when the peak happens: "start of backward", "end of backward" or "optimizer step"
    peak_phase: str = ""
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        persistent = self.frozen_weights + self.buffers + self.trainable_params
        persistent += self.optimizer_states
        # backward starts with every activation saved and ends with every gradient made while
        # the last layer's activations (or its recomputation) are still alive
        start = self.activations + self.logits + self.workspace + self.lm_head_grad
        if self.cuda_graph and not self.optimizer_in_backward:
            start += self.gradients - self.lm_head_grad  # every gradient, lm_head's included
        if self.optimizer_in_backward:
            # updated as they complete: lm_head's gradient (and its update's temporary) at the
            # start, at most one layer's gradients later; no separate optimizer step
            start += self.in_backward_transient
            end = self.in_backward_gradients + self.layer_activations + self.workspace
            step = 0
        else:
            end = self.gradients + self.layer_activations + self.workspace
            step = self.gradients + self.optimizer_transient
        phases = {"start of backward": start, "end of backward": end, "optimizer step": step}
        self.peak_phase = max(phases, key=phases.__getitem__)  # the first of equal ones
        self.peak = persistent + phases[self.peak_phase]

    def to_dict(self) -> dict:
        """JSON-ready dict (bytes as ints)."""
        return asdict(self)


def parse_bytes(text: str) -> int:
    """``"80GB"`` / ``"80GiB"`` / ``"141 GiB"`` / ``"500MB"`` / ``"1e9"`` → bytes.

    GB and GiB are both read as 2**30 (as ``nvidia-smi`` and torch report), MB as 2**20; a bare
    number is bytes. Any size below 2**20 is an error (``80`` or ``80kB`` is surely a slip).

    Raises:
        EstimateError: the text is not a size.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b?)?\s*", text.lower())
    if not m:
        raise EstimateError(f"cannot read memory size '{text}'; write e.g. 80GB, 141GiB or 500MB")
    if m.group(2) is None and float(m.group(1)) < 2**20:  # "80": surely not 80 bytes of GPU
        example = f"{m.group(1)}GB" if float(m.group(1)) > 0 else "80GB"
        raise EstimateError(
            f"memory size '{text}' has no unit; write e.g. {example} (a bare number is "
            "bytes and must be at least 1 MiB)"
        )
    scale = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}.get((m.group(2) or " ")[0], 1)
    size = int(float(m.group(1)) * scale)
    if size <= 0:
        raise EstimateError(f"memory size '{text}' must be positive; write e.g. 80GB")
    if size < 2**20:  # "80kB": a unit slip, not a GPU
        raise EstimateError(f"memory size '{text}' is below 1 MiB; write e.g. 80GB")
    return size


def _gpu_kernel_path(kernels: KernelPolicy, switch: str, precision: Precision) -> bool:
    """Whether the run this estimate describes takes the GPU-only path ``switch`` (a
    :class:`~quant_kernels.policy.KernelPolicy` field): never for ``fp32`` (CPU training: CPU
    tensors take the torch path) nor without Triton (``POETXQ_KERNELS=torch``). The precision
    stands for the device: ``autocast`` / ``bf16-true`` estimates describe a GPU run (a CPU run
    in bf16 takes no such path and keeps a little more; a GPU run in fp32 takes them and keeps a
    little less)."""
    return precision != "fp32" and kernels.on_gpu(switch)


def _lean_fast_swiglu(kernels: KernelPolicy, precision: Precision) -> bool:
    """Whether the run takes the lean ``fast`` SwiGLU down projection (``lean_fast_swiglu``,
    which runs inside the fast variant's feature-major path, behind its own switch)."""
    return _gpu_kernel_path(kernels, "lean_fast_swiglu", precision) and _gpu_kernel_path(
        kernels, "fast_feature_major", precision
    )


def _fused_input_cast(kernels: KernelPolicy, precision: Precision) -> bool:
    """Whether the run passes fp32 inputs uncast into feature-major ``mem`` POET layers
    (``fused_input_cast``, taken only where the layer is feature-major): only under autocast,
    where the inputs are fp32 and the compute bf16."""
    return (
        precision == "autocast"
        and _gpu_kernel_path(kernels, "fused_input_cast", precision)
        and _gpu_kernel_path(kernels, "feature_major", precision)
    )


#: projections of a decoder layer that read one shared input (the attention norm's, the MLP
#: norm's output)
_SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _fused_cast_saving(recipe: Recipe, targets: set[str], bits: int, b: int) -> int:
    """Bytes per token and decoder layer that ``mem`` layers save less under bf16 autocast when
    they take their fp32 input uncast (:func:`_fused_input_cast`): each feature-major projection
    of a group keeps the group's one fp32 input (``4d``, shared) instead of its own bf16 copy
    (``2d``). q/k/v: ``6d → 4d``; gate/up: ``4d → 4d``. Negative for a group with one such
    projection. Feature-major: in ``targets``, no ragged side (any store: the 4-bit one's
    input-order wrapper gathers feature-major rows)."""
    d = recipe.model.hidden_size
    dims = {name: (m, n) for name, m, n in _projections(recipe)}
    saving = 0
    for group in _SHARED_INPUT_GROUPS:
        fm = [
            g for g in group
            if g in targets and dims[g][0] % b == 0 and dims[g][1] % b == 0
        ]  # fmt: skip
        if fm:
            saving += 2 * d * len(fm) - 4 * d
    return saving


def _projections(recipe: Recipe) -> list[tuple[str, int, int]]:
    """``(name, out m, in n)`` of one decoder layer's projections."""
    mc = recipe.model
    d, f = mc.hidden_size, mc.intermediate_size
    hd = d // mc.num_attention_heads
    kv = (mc.num_key_value_heads or mc.num_attention_heads) * hd
    return [("q_proj", d, d), ("k_proj", kv, d), ("v_proj", kv, d), ("o_proj", d, d),
            ("gate_proj", f, d), ("up_proj", f, d), ("down_proj", d, f)]  # fmt: skip


def frozen_store_bytes(
    m: int, n: int, bits: int, *, double_quant: bool = True, elt: int = 4
) -> int:
    """Bytes of one POET frozen store ``[m, n]`` (:mod:`poetxq.model.quant` buffers).

    Args:
        m, n: out / in features.
        bits: 8 (int8 row-wise), 4 (NF4/FP4 blockwise), 16 (dense in a dtype of ``elt`` bytes).
        double_quant: 4-bit absmax quantized again.
        elt: bytes per element of a dense store.
    """
    if bits == 8:
        return m * n + 4 * m + 1  # CB int8, SCB fp32, weight_format uint8
    if bits == 4:
        blocks = math.ceil(m * n / NF4_BLOCK)
        out = math.ceil(m * n / 2) + 16 * 4  # packed codes, quant_map
        if double_quant:
            out += blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 256 * 4 + 4
        else:
            out += 4 * blocks
        return out
    return m * n * elt


def _side(dim: int, b: int) -> tuple[int, int, bool]:
    """``(blocks, packed entries per block, ragged)`` of one orthogonal side."""
    nb = math.ceil(dim / b)
    return nb, b * (b - 1) // 2, dim % b != 0


def _lowrank_state_bytes(m: int, n: int, recipe: Recipe) -> int:
    """Bytes LowRankAdamW keeps for one ``[m, n]`` low-rank weight after its first step."""
    from poetxq.baselines import resolved_settings

    s = resolved_settings(recipe.method, recipe.baseline)
    r = min(s["rank"], m, n)
    right = m >= n
    low = m * r if right else r * n
    if s["state_bits"] == 8:
        moments = 2 * (low + 4 * math.ceil(low / STATE_BLOCK))
    else:
        moments = 2 * 4 * low
    proj_numel = r * n if right else m * r
    if s["method"] == "apollo":
        return moments + 4 * proj_numel + 4  # projector fp32, prev_norm fp32 scalar
    if s["proj_bits"] == 4:
        groups = math.ceil(proj_numel / s["proj_group_size"])
        proj = math.ceil(proj_numel / 2) + 2 * 4 * groups
    else:
        proj = 4 * proj_numel
    lazy = 4 * (n if right else m) if s["lazy"] else 0
    return moments + proj + lazy


def estimate_memory(
    recipe: Recipe,
    *,
    vocab_size: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    precision: Precision = "autocast",
    kernels: KernelPolicy | None = None,
) -> MemoryEstimate:
    """Estimate the memory of one steady-state training step of ``recipe`` (module docstring).

    Args:
        recipe: validated recipe (model shape, method, POET / baseline settings, checkpointing).
        vocab_size: tokenizer vocabulary (default: ``data.vocab_size``, the BPE size).
        batch_size: sequences per micro-batch (default ``train.batch_size``).
        seq_len: tokens per sequence (default ``train.seq_len``).
        precision: ``"autocast"`` (fp32 parameters, bf16 compute: ``poetxq train`` on a GPU),
            ``"bf16-true"`` (parameters and compute in bf16, ``train.precision: bf16-true``, the
            official code's setting) or ``"fp32"`` (CPU training).
        kernels: the kernel policy the run's layers are built with (what they keep for backward
            depends on it); default :func:`quant_kernels.policy.default_policy`, as the layers'.

    Returns:
        :class:`MemoryEstimate` with every component in bytes.

    Raises:
        EstimateError: unknown ``precision``, or a size below 1.
    """
    if precision not in PRECISIONS:
        raise EstimateError(f"unknown precision '{precision}'; choose one of {PRECISIONS}")
    for flag, size in (("vocab-size", vocab_size), ("batch-size", batch_size),
                       ("seq-len", seq_len)):  # fmt: skip
        if size is not None and size < 1:  # 0 would fall back to the recipe's value silently
            raise EstimateError(f"--{flag} must be a positive integer, got {size}")
    kernels = default_policy() if kernels is None else kernels
    mc, pc, tc, oc = recipe.model, recipe.poet, recipe.train, recipe.optim
    V = vocab_size or recipe.data.vocab_size
    B = batch_size or tc.batch_size
    S = seq_len or tc.seq_len
    T = B * S
    d, f, h, L = mc.hidden_size, mc.intermediate_size, mc.num_attention_heads, mc.num_hidden_layers
    hd = d // h
    p = 2 if precision == "bf16-true" else 4  # parameter (and Q) bytes
    c = 4 if precision == "fp32" else 2  # compute (activation) bytes
    r = p  # residual stream follows the embedding output dtype
    is_poet = recipe.method in POET_METHODS
    quantized = recipe.method in ("qgalore", "qapollo")
    lowrank = recipe.method in ("galore", "apollo", "qgalore", "qapollo")
    targets = set(pc.target_modules if is_poet else recipe.baseline.target_modules)
    bits = 16 if recipe.method == "poetx" else pc.bits
    b = pc.block_size
    notes: list[str] = []

    frozen = buffers = params = grads = states = opt_tmp = 0
    n_train = n_frozen = q_bytes = 0
    cnp_const = 0  # saved Cayley–Neumann intermediates per decoder layer
    ckpt_q = 0  # under checkpointing: the recomputed layer's concatenated Q (unless flat)
    flat_gapless = True  # every side's Q fills whole 8-bit state blocks (no gaps in the buffer)
    fast_extra = 0  # per token and layer, fast variant
    cast_weights = 0  # autocast bf16 copies of nn.Linear weights per layer
    largest_mn = max(m * n for _, m, n in _projections(recipe))
    lowrank_states = 0
    group = recipe.baseline.weight_group_size or (256 if recipe.method == "qgalore" else 128)

    def adam_states(numel: int) -> int:
        """POET methods' AdamW moments of one tensor: torch (param dtype + 4-byte step tensor)
        or bitsandbytes AdamW8bit (uint8 codes + fp32 absmax per 256 + two 256-entry qmaps for
        tensors of >= 4096 elements, fp32 below; its step is a Python int)."""
        if oc.state_bits == 32:
            return 2 * numel * p + 4
        if numel < 4096:
            return 2 * numel * 4
        return 2 * numel + 2 * 4 * math.ceil(numel / 256) + 2 * 256 * 4

    def adam_param(numel: int) -> None:
        """A parameter trained with plain AdamW (torch's, or LowRankAdamW's adamw group)."""
        nonlocal params, grads, states, n_train
        params += numel * p
        grads += numel * p
        n_train += numel
        # torch AdamW: moments in the param dtype + a 4-byte step; LowRankAdamW: fp32 moments
        states += 8 * numel if lowrank else adam_states(numel)

    for name, m, n in _projections(recipe):
        if name not in targets:
            adam_param(m * n)
            cast_weights += m * n * 2 if precision == "autocast" else 0
            continue
        if is_poet:
            frozen += frozen_store_bytes(m, n, bits, double_quant=pc.double_quant, elt=p)
            n_frozen += m * n
            for dim in (n, m):
                nb, per, ragged = _side(dim, b)
                q_numel = nb * per
                params += q_numel * p
                q_bytes += q_numel * p
                grads += q_numel * p
                states += adam_states(q_numel)
                n_train += q_numel
                buffers += 2 * 8 * dim + (q_numel * p if ragged else 0)
                # the blocks G in the compute dtype, saved by the layer; the CNP saves only its
                # packed input (quant_kernels.cayley_neumann_lean): the parameter itself, or a
                # masked copy of a ragged side's Q when each layer computes its own blocks
                cnp_const += nb * b * b * c
                flat_gapless = flat_gapless and not ragged and q_numel % BNB_STATE_BLOCK == 0
                if tc.gradient_checkpointing:  # the recomputed layer's one lean CNP keeps
                    ckpt_q += q_numel * p  # its input, the layer's concatenated Q
                fast_extra += c * nb * b
        elif quantized:
            frozen += m * n + 2 * 4 * math.ceil(m * n / group)
            n_frozen += m * n
            grads += 4 * m * n  # float_grad
            lowrank_states += _lowrank_state_bytes(m, n, recipe)
            n_train += m * n
        else:
            params += m * n * p
            grads += m * n * p
            n_train += m * n
            cast_weights += m * n * 2 if precision == "autocast" else 0
            if lowrank:
                lowrank_states += _lowrank_state_bytes(m, n, recipe)
            else:
                states += 2 * m * n * p + 4
    # poetxq.model.flat (8-bit states): when no side leaves a gap, Q lies end to end and the CNP
    # reads it through a view, no copy
    flat_q = is_poet and oc.state_bits == 8 and flat_gapless
    if not flat_q:
        cnp_const += ckpt_q
    in_backward_grads = grads  # one layer's
    frozen, buffers, params, grads, states = (
        x * L for x in (frozen, buffers, params, grads, states)
    )
    q_bytes *= L
    if is_poet and not tc.gradient_checkpointing and not pc.freeze_orthogonal:
        in_backward_grads = q_bytes  # the batched CNP's backward yields every Q gradient at once
    states += lowrank_states * L
    n_train *= L
    n_frozen *= L
    # embeddings, lm_head, norms (2 per layer + final)
    for numel in [V * d] + ([] if mc.tie_word_embeddings else [V * d]) + [d] * (2 * L + 1):
        adam_param(numel)
    lm_head_grad = V * d * p

    # --- activations (bytes saved by autograd) -------------------------------------------------
    slope = {"bf16-true": 24 * d + 8 * f, "autocast": 34 * d + 8 * f, "fp32": 40 * d + 16 * f}
    layer_tok = slope[precision] + 8 + 4 * h
    if is_poet and pc.variant == "mem":
        # POETXSwiGLUMLP: SiLU(gate) and the product are recomputed, only gate and up are kept
        layer_tok -= (8 if precision == "fp32" else 4) * f
    if is_poet and pc.variant == "fast":
        # the inputs mem layers keep and fast layers do not (norm outputs, down_proj input)
        saved_inputs = {"bf16-true": 2 * (2 * d + f), "autocast": 2 * (5 * d + f)}
        saved_inputs["fp32"] = 4 * (2 * d + f)
        layer_tok += fast_extra - saved_inputs[precision]
        mlp = {"gate_proj", "up_proj", "down_proj"} <= targets  # POETXSwiGLUMLP wraps it
        # the lean path needs the feature-major one: no ragged side
        if _lean_fast_swiglu(kernels, precision) and mlp and f % b == 0 and d % b == 0:
            # poetxq.model.layer_fm._SwiGLUDownFastFmFn: neither SiLU(gate) nor the down
            # projection's permuted input is kept (both recomputed in backward)
            layer_tok -= 2 * c * f
            notes.append("lean fast SwiGLU (kernel policy lean_fast_swiglu): 2·f fewer saved")
    if is_poet and pc.variant == "mem" and _fused_input_cast(kernels, precision):
        saving = _fused_cast_saving(recipe, targets, bits, b)
        layer_tok -= saving
        if saving:
            notes.append(
                f"fused input cast (kernel policy fused_input_cast): {saving} bytes less per "
                "token and layer (fp32 inputs shared, no bf16 copy per projection)"
            )
    head_norm = {"bf16-true": 8 * d + 4, "autocast": 10 * d + 4, "fp32": 12 * d + 4}[precision]
    graph = graph_wanted(recipe, "cuda")  # what a GPU run of this recipe does
    if graph and tc.optimizer_in_backward and tc.loss_chunk_tokens and not mc.tie_word_embeddings:
        # the chunked loss hands it to the update inside the graph a slice at a time
        lm_head_grad = min(lm_head_grad, SLICE_BYTES)
    if precision != "fp32" and fuse_wanted(tc, "cuda", graph):
        # poetxq.model.fuse: a compiled RMSNorm keeps its input and the per-row scale, not an fp32
        # copy of its input beside the normalized rows (4d bytes per token less per norm)
        layer_tok -= 2 * 4 * d
        head_norm -= 4 * d
        notes.append(
            "fused RMSNorm (train.fuse_elementwise on a GPU): 8d bytes less per token and layer"
        )
    layer_const = cnp_const + cast_weights
    layer_full = T * layer_tok + layer_const
    rotary = 2 * S * hd * (2 if precision == "bf16-true" else 4)  # cos, sin [1, S, head_dim]
    head = 8 * B * (S + 1) + rotary + T * head_norm
    head += V * d * 2 if precision == "autocast" else 0  # bf16 copy of lm_head's weight
    host = 0
    if tc.gradient_checkpointing:
        acts = head + layer_full  # one layer recomputed, + the layer inputs unless offloaded
        inputs = L * T * d * r
        if tc.offload_activations and precision != "fp32":
            host = inputs
            notes.append(
                f"offload: the layer inputs ({host / 2**30:.2f} GiB) wait in pinned host memory"
            )
        else:
            acts += inputs
            if tc.offload_activations:
                notes.append("offload: no effect on the CPU (activations are in host memory)")
        notes.append("checkpointing: each layer keeps its input; one layer is recomputed at a time")
    else:
        acts = L * layer_full + head
        if is_poet and not pc.freeze_orthogonal and not flat_q:
            acts += q_bytes  # poetxq.model.blockcache: the concatenated Q of all sides, saved once
    # forward: bf16 logits + fp32 copy + log-softmax (c + 8)·T·V; loss backward: log-softmax
    # output + its gradient + the logits' gradient, 12·T·V (the larger)
    logits = max(c + 8, 12) * T * V
    if tc.loss_chunk_tokens:  # poetxq.training.loss: one chunk's logits at a time
        logits = max(c + 8, 12) * min(T, tc.loss_chunk_tokens) * V

    # --- transients --------------------------------------------------------------------------
    max_dim = max(max(m, n) for _, m, n in _projections(recipe))
    workspace = 4 * c * T * max_dim
    if (is_poet and bits in (4, 8)) or quantized:
        workspace += largest_mn * c  # a dequantized weight on the GEMM path
    if lowrank:  # dequantized/fp32 weight, gradient, update, noise of the largest weight
        opt_tmp = 4 * 4 * largest_mn
    else:  # torch AdamW foreach (the CPU) keeps a temporary the size of the largest group; the
        # fused CUDA step (poetxq.training.optim.adamw) and bitsandbytes keep none: conservative on
        # a GPU
        opt_tmp = max(q_bytes, params - q_bytes)
    if precision == "fp32":
        notes.append("fp32: CPU training; compare with the process RSS, not CUDA memory")
    elif graph and tc.optimizer_in_backward:
        notes.append(
            "CUDA graph (train.cuda_graph): the activations live in the graph's private pool "
            "and the optimizer runs inside the captured backward, which frees each gradient "
            "after its update (lm_head's, with a chunked loss, a slice of rows at a time); "
            "compare with the reserved peak"
        )
    elif graph:
        notes.append(
            "CUDA graph (train.cuda_graph): the activations live in the graph's private pool, "
            "the gradients exist for the whole step; compare with the reserved peak "
            "(train.cuda_graph=false: eager, gradients made during backward)"
        )
    return MemoryEstimate(
        recipe=recipe.name, method=method_label(recipe), precision=precision, batch_size=B,
        seq_len=S, vocab_size=V, gradient_checkpointing=tc.gradient_checkpointing,
        frozen_weights=frozen, buffers=buffers, trainable_params=params, gradients=grads,
        optimizer_states=states, activations=acts, logits=logits, workspace=workspace,
        optimizer_transient=opt_tmp, lm_head_grad=lm_head_grad, num_trainable=n_train,
        num_frozen=n_frozen, layer_activations=layer_full, head_activations=head,
        optimizer_in_backward=tc.optimizer_in_backward, in_backward_gradients=in_backward_grads,
        in_backward_transient=lm_head_grad if oc.state_bits == 32 else 0,
        host_offloaded=host, loss_chunk_tokens=tc.loss_chunk_tokens, notes=notes,
        cuda_graph=graph and precision != "fp32",
    )  # fmt: skip


#: how far above the estimate a CUDA-graph run's *reserved* peak has measured (the graph's
#: private pool fragments): at most 14.4 % on an H200, Llama-8B / 13B with and without
#: checkpointing and a chunked loss (``evals/results/gpu_memory_graph_h200_90a76c3.json``,
#: ``gpu_memory_graph_ckpt_chunk_h200_90a76c3.json``); 2–10 % with the optimizer inside the graph
#: (``gpu_memory_*_graph_oib*_h200_*.json``)
GRAPH_POOL_OVERHEAD = 0.144


def _size(x: int) -> str:
    """A GPU's memory for a verdict line: GiB to 0.1, MiB below 1 GiB."""
    return f"{x / 2**30:.1f} GiB" if x >= 2**30 else f"{x / 2**20:.0f} MiB"


def _gib(x: int) -> str:
    return f"{x / 2**30:9.3f} GiB"


def other_variant(recipe: Recipe, **kwargs: Any) -> tuple[str, int] | None:
    """For a POET recipe, the other layer variant (``mem`` <-> ``fast``) and its predicted peak
    in bytes, so a user can see what the faster ``fast`` variant would need; None for the
    baselines. ``kwargs`` are :func:`estimate_memory`'s (vocab size, batch, seq, precision)."""
    if recipe.method not in POET_METHODS:
        return None
    other = "fast" if recipe.poet.variant == "mem" else "mem"
    alt = recipe.model_copy(update={"poet": recipe.poet.model_copy(update={"variant": other})})
    return other, estimate_memory(alt, **kwargs).peak


def format_other_variant(other: str, peak: int, gpu_mem: int | None = None) -> str:
    """The line :func:`format_estimate`'s table ends with for a POET recipe (see
    :func:`other_variant`), with fits / does not fit against ``gpu_mem`` bytes."""
    why = (
        "keeps each layer's GEMM output: one weight GEMM less per layer and step"
        if other == "fast"
        else "recomputes each layer's GEMM output in backward: less memory, slower"
    )
    fits = ""
    if gpu_mem is not None:
        fits = ("fits" if peak <= gpu_mem else "does not fit") + f" in {_size(gpu_mem)}; "
    return f"  {f'peak with poet.variant={other}':<31s}{_gib(peak)}  {fits}{why}"


def format_estimate(est: MemoryEstimate, gpu_mem: int | None = None) -> str:
    """A plain-text table of the breakdown and, with ``gpu_mem`` (bytes), fits / does not fit."""
    ckpt = "on" if est.gradient_checkpointing else "off"
    rows = [
        ("frozen / quantized weights", est.frozen_weights, f"{est.num_frozen:,} weights"),
        ("buffers (permutations, masks)", est.buffers, ""),
        ("trainable parameters", est.trainable_params, f"{est.num_trainable:,} parameters"),
        (
            (
                "gradients",
                est.in_backward_gradients,
                f"alive at once, optimizer in backward (all: {est.gradients / 2**30:.3f} GiB)",
            )
            if est.optimizer_in_backward
            else (
                "gradients",
                est.gradients,
                "static in the CUDA graph: all present from the start of backward"
                if est.cuda_graph
                else "all present at the optimizer step",
            )
        ),
        ("optimizer states", est.optimizer_states, ""),
        ("activations", est.activations, f"checkpointing {ckpt}"),
        (
            "logits / loss",
            est.logits,
            f"[{est.batch_size * est.seq_len}, {est.vocab_size}]"
            + (f" in chunks of {est.loss_chunk_tokens} tokens" if est.loss_chunk_tokens else ""),
        ),
        ("workspace", est.workspace, "largest layer's transients"),
        ("optimizer temporaries", est.in_backward_transient, "per parameter, inside backward")
        if est.optimizer_in_backward
        else ("optimizer temporaries", est.optimizer_transient, "during optimizer.step"),
    ]
    if est.host_offloaded:
        rows.append(("offloaded to host (not GPU)", est.host_offloaded, "checkpointed inputs"))
    head = (
        f"memory estimate: {est.recipe} ({est.method}), batch {est.batch_size} x seq "
        f"{est.seq_len}, vocab {est.vocab_size:,}, {est.precision}"
    )
    lines = [head, "-" * len(head)]
    lines += [f"  {name:<31s}{_gib(v)}  {note}".rstrip() for name, v, note in rows]
    lines.append(f"  {'predicted peak':<31s}{_gib(est.peak)}  at the {est.peak_phase}")
    if gpu_mem is not None:
        verdict = "fits" if est.peak <= gpu_mem else "does not fit"
        lines.append(f"  {verdict} in {_size(gpu_mem)} ({est.peak / gpu_mem:.0%} used)")
        if est.cuda_graph:
            high = int(est.peak * (1 + GRAPH_POOL_OVERHEAD))
            verdict = "fits" if high <= gpu_mem else "does not fit"
            lines.append(
                f"  with the graph pool's measured overhead (reserved up to "
                f"+{GRAPH_POOL_OVERHEAD:.0%}): {high / 2**30:.3f} GiB, {verdict}"
            )
    lines += [f"  note: {n}" for n in est.notes]
    return "\n".join(lines)
