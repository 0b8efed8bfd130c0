# Over 500 lines: one function counts every term of one step (and the merge) from the same
# shapes; its module docstring is the term-by-term reference the tests check against.
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
  Muon (:class:`~poetxq.baselines.muon.MuonAdamW`): one momentum buffer per hidden matrix, AdamW's
  two moments for the rest;
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
``T``'s. ``train.offload_optimizer`` (:class:`poetxq.training.offload.HostOffload`) keeps the
gradients and optimizer states in host memory; on the GPU stay one decoder layer's gradients in
backward, the largest gradient's accumulator brought back to add a micro-batch's gradient to it
(with ``train.grad_accum`` > 1), the per-gradient norms of the step's last micro-batch (one
allocator block each, :data:`CUDA_BLOCK`; their stacked copy in the update, ``4`` bytes each, is
left out) and, in the update, one parameter's gradient and states.
Checked against real byte counts of built models and optimizers and against autograd's saved
tensors in ``tests/test_estimate.py``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from poetxq.model.flat import BNB_STATE_BLOCK
from poetxq.model.fuse import fuse_wanted
from poetxq.training.cudagraph import graph_wanted
from poetxq.training.estimate_terms import (
    PRECISIONS,
    Precision,
    frozen_store_bytes,
    fused_cast_saving,
    fused_input_cast,
    lean_fast_swiglu,
    lowrank_state_bytes,
    projections,
    side_blocks,
    trained_entries,
)
from poetxq.training.loss import SLICE_BYTES
from poetxq.training.recipe import POET_METHODS, Recipe, method_label
from quant_kernels.policy import KernelPolicy, default_policy

if TYPE_CHECKING:
    from poetxq.training.plan import RunPlan

#: how far above the estimate a CUDA-graph run's *reserved* peak has measured (the graph's
#: private pool fragments): at most 14.4 % on an H200, Llama-8B / 13B with and without
#: checkpointing and a chunked loss (``evals/results/gpu_memory_graph_h200_90a76c3.json``,
#: ``gpu_memory_graph_ckpt_chunk_h200_90a76c3.json``); 2–10 % with the optimizer inside the graph
#: (``gpu_memory_*_graph_oib*_h200_*.json``)
GRAPH_POOL_OVERHEAD = 0.144
#: the CUDA caching allocator's smallest block: a 0-d tensor on the GPU takes this many bytes of
#: ``torch.cuda.memory_allocated``
CUDA_BLOCK = 512


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
    num_trainable: int  # numbers that train (masked entries of Q excluded; int8 weights count)
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
    #: train.offload_optimizer: gradients and optimizer states wait in host memory
    #: (poetxq.training.offload.HostOffload); the GPU holds one parameter's share at a time
    offload_optimizer: bool = False
    #: with offload_optimizer: the largest parameter's gradient and optimizer states, on the GPU
    #: during its update after backward
    offload_transient: int = 0
    #: with offload_optimizer and gradient accumulation: the largest gradient's accumulator,
    #: brought back from the host beside the new gradient (from the second micro-batch on)
    offload_accumulator: int = 0
    #: with offload_optimizer: the step's per-gradient norms (0-d fp32 tensors, one allocator
    #: block of CUDA_BLOCK bytes each), kept on the GPU from the last micro-batch's backward to
    #: the end of the update
    offload_norms: int = 0
    #: pinned host memory: the checkpointed layer inputs (train.offload_activations), and the
    #: gradients and optimizer states (train.offload_optimizer)
    host_offloaded: int = 0
    host_optimizer: int = 0  #: the part of host_offloaded that is gradients and states
    #: POET methods: a merge's fp32 temporaries for the largest layer (two [m, n] copies, three
    #: where a side is padded to whole blocks; :meth:`poetxq.model.layer.POETXLinear.\
    #: merge_then_reinitialize`), between steps, when no activation is alive
    merge_workspace: int = 0
    loss_chunk_tokens: int = 0  # train.loss_chunk_tokens (0: whole logits)
    grad_accum: int = 1  # train.grad_accum: micro-batches of batch_size x seq_len per step
    #: train.cuda_graph on a GPU: the gradients are static tensors made before the capture
    #: (poetxq.training.cudagraph.GraphedMicroStep), so all of them exist from the start of backward
    #: (unless optimizer_in_backward: then the update is inside the captured backward)
    cuda_graph: bool = False
    peak: int = 0
    #: when the peak happens: "start of backward", "end of backward", "optimizer step" or
    #: "merge"
    peak_phase: str = ""
    #: the peak's composition: (term, bytes) pairs at ``peak_phase`` summing to ``peak`` (the
    #: breakdown's rows are each term's largest size over the step and need not add up to it)
    peak_terms: list[tuple[str, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        persistent = [("frozen weights", self.frozen_weights), ("buffers", self.buffers),
                      ("parameters", self.trainable_params)]  # fmt: skip
        if not self.offload_optimizer:
            persistent.append(("optimizer states", self.optimizer_states))
        # backward starts with every activation saved and ends with every gradient made while
        # the last layer's activations (or its recomputation) are still alive
        start = [("activations", self.activations), ("logits", self.logits),
                 ("workspace", self.workspace),
                 ("lm_head gradient", self.lm_head_grad)]  # fmt: skip
        if self.cuda_graph and not self.optimizer_in_backward:
            # every gradient, lm_head's included
            start.append(("other gradients", self.gradients - self.lm_head_grad))
        if self.offload_optimizer:
            # each gradient leaves for the host as it completes (lm_head's first, joined from
            # the second micro-batch on by its accumulator); after backward one parameter's
            # gradient and states at a time come back for its update
            start.append(("offload accumulator", self.offload_accumulator))
            end = [("gradients alive", self.in_backward_gradients),
                   ("last layer's activations", self.layer_activations),
                   ("workspace", self.workspace),
                   ("offload accumulator", self.offload_accumulator),
                   ("gradient norms", self.offload_norms)]  # fmt: skip
            step = [("one parameter's gradient and states", self.offload_transient),
                    ("gradient norms", self.offload_norms)]  # fmt: skip
        elif self.optimizer_in_backward:
            # updated as they complete: lm_head's gradient (and its update's temporary) at the
            # start, at most one layer's gradients later; no separate optimizer step
            start.append(("optimizer temporaries", self.in_backward_transient))
            end = [("gradients alive", self.in_backward_gradients),
                   ("last layer's activations", self.layer_activations),
                   ("workspace", self.workspace)]  # fmt: skip
            step = []
        else:
            end = [("gradients", self.gradients),
                   ("last layer's activations", self.layer_activations),
                   ("workspace", self.workspace)]  # fmt: skip
            step = [("gradients", self.gradients),
                    ("optimizer temporaries", self.optimizer_transient)]  # fmt: skip
        phases = {"start of backward": start, "end of backward": end, "optimizer step": step}
        if self.merge_workspace:  # between steps: no activation; a graph's static gradients
            merge = [("merge workspace", self.merge_workspace)]
            if self.cuda_graph and not self.optimizer_in_backward:
                merge.append(("gradients", self.gradients))
            phases["merge"] = merge
        totals = {k: sum(b for _, b in v) for k, v in phases.items()}
        self.peak_phase = max(totals, key=totals.__getitem__)  # the first of equal ones
        self.peak_terms = [(n, b) for n, b in persistent + phases[self.peak_phase] if b]
        self.peak = sum(b for _, b in persistent) + totals[self.peak_phase]

    def to_dict(self) -> dict:
        """JSON-ready dict (bytes as ints)."""
        return asdict(self)


def estimate_memory(
    recipe: Recipe,
    *,
    vocab_size: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    precision: Precision = "autocast",
    kernels: KernelPolicy | None = None,
    plan: RunPlan | None = None,
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
        plan: the run plan of a CUDA run (:func:`poetxq.training.plan.resolve_plan`): its
            ``cuda_graph`` and ``fuse`` decide what the step holds. Default (and for a plan of
            another device): what a one-process GPU run of ``recipe`` decides, by the plan's
            own deciding functions (the memory plan estimates before a run plan exists).

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
    hd = mc.head_width
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
    n_tensors = 0  # trainable tensors (the POET methods' and AdamW's: one gradient each)
    cnp_const = 0  # saved Cayley–Neumann intermediates per decoder layer
    ckpt_q = 0  # under checkpointing: the recomputed layer's concatenated Q (unless flat)
    flat_gapless = True  # every side's Q fills whole 8-bit state blocks (no gaps in the buffer)
    fast_extra = 0  # per token and layer, fast variant
    cast_weights = 0  # autocast bf16 copies of nn.Linear weights per layer
    largest_mn = max(m * n for _, m, n in projections(recipe))
    lowrank_states = 0
    largest_train = 0  # elements of the largest trainable tensor
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
        nonlocal params, grads, states, n_train, n_tensors, largest_train
        params += numel * p
        grads += numel * p
        n_train += numel
        n_tensors += 1
        largest_train = max(largest_train, numel)
        # torch AdamW: moments in the param dtype + a 4-byte step; LowRankAdamW: fp32 moments
        states += 8 * numel if lowrank else adam_states(numel)

    for name, m, n in projections(recipe):
        if name not in targets:
            adam_param(m * n)
            cast_weights += m * n * 2 if precision == "autocast" else 0
            continue
        if is_poet:
            frozen += frozen_store_bytes(m, n, bits, double_quant=pc.double_quant, elt=p)
            n_frozen += m * n
            for dim in (n, m):
                nb, per, ragged = side_blocks(dim, b)
                q_numel = nb * per
                largest_train = max(largest_train, q_numel)
                params += q_numel * p
                q_bytes += q_numel * p
                grads += q_numel * p
                states += adam_states(q_numel)
                n_train += trained_entries(dim, b, pc.structure)
                n_tensors += 1
                # perm + inv_perm (int64); a mask of Q where entries are held at zero (a ragged
                # last block's padding, or every block but one for POET-FS)
                masked = ragged or pc.structure == "full"
                buffers += 2 * 8 * dim + (q_numel * p if masked else 0)
                # the blocks G in the compute dtype, saved by the layer; the CNP saves only its
                # packed input (quant_kernels.cayley_neumann): the parameter itself, or a
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
            lowrank_states += lowrank_state_bytes(m, n, recipe)
            n_train += m * n
        else:
            params += m * n * p
            grads += m * n * p
            n_train += m * n
            cast_weights += m * n * 2 if precision == "autocast" else 0
            if lowrank:
                lowrank_states += lowrank_state_bytes(m, n, recipe)
            elif recipe.method == "muon":  # torch.optim.Muon: one momentum buffer
                states += m * n * p
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
    n_tensors *= L
    n_frozen *= L
    # embeddings, lm_head, norms (2 per layer + final)
    for numel in [V * d] + ([] if mc.tie_word_embeddings else [V * d]) + [d] * (2 * L + 1):
        adam_param(numel)
    lm_head_grad = V * d * p

    # --- activations (bytes saved by autograd) -------------------------------------------------
    slope = {"bf16-true": 24 * d + 8 * f, "autocast": 34 * d + 8 * f, "fp32": 40 * d + 16 * f}
    layer_tok = slope[precision] + 8 + 4 * h
    if h * hd != d:  # the fitted slope's attention terms are in units of d
        notes.append(
            f"attention activations estimated at width d = {d}, not heads x head_dim = {h * hd} "
            "(fitted on Llama shapes); weights and optimizer states use the true widths"
        )
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
        if lean_fast_swiglu(kernels, precision) and mlp and f % b == 0 and d % b == 0:
            # poetxq.model.functions.SwiGLUDownFn (keep_h=False): neither SiLU(gate) nor the down
            # projection's permuted input is kept (both recomputed in backward)
            layer_tok -= 2 * c * f
            notes.append("lean fast SwiGLU (kernel policy lean_fast_swiglu): 2·f fewer saved")
    if is_poet and pc.variant == "mem" and fused_input_cast(kernels, precision):
        saving = fused_cast_saving(recipe, targets, bits, b)
        layer_tok -= saving
        if saving:
            notes.append(
                f"fused input cast (kernel policy fused_input_cast): {saving} bytes less per "
                "token and layer (fp32 inputs shared, no bf16 copy per projection)"
            )
    head_norm = {"bf16-true": 8 * d + 4, "autocast": 10 * d + 4, "fp32": 12 * d + 4}[precision]
    on_gpu = plan is not None and plan.device == "cuda"
    graph = plan.cuda_graph if on_gpu else graph_wanted(recipe, "cuda")  # a GPU run's
    if graph and tc.optimizer_in_backward and tc.loss_chunk_tokens and not mc.tie_word_embeddings:
        # the chunked loss hands it to the update inside the graph a slice at a time
        lm_head_grad = min(lm_head_grad, SLICE_BYTES)
    fused = plan.fuse if on_gpu else fuse_wanted(tc, "cuda", graph)
    if precision != "fp32" and fused:
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
    offload_tmp = offload_acc = offload_norms = 0
    if tc.offload_optimizer:
        host += grads + states
        offload_tmp = largest_train * p + adam_states(largest_train)
        offload_acc = largest_train * p if tc.grad_accum > 1 else 0
        offload_norms = n_tensors * CUDA_BLOCK
        notes.append(
            f"offload: gradients and optimizer states ({(grads + states) / 2**30:.2f} GiB) wait "
            "in pinned host memory; one parameter's at a time on the GPU for its update"
        )
    if tc.gradient_checkpointing:
        acts = head + layer_full  # one layer recomputed, + the layer inputs unless offloaded
        inputs = L * T * d * r
        if tc.offload_activations and precision != "fp32":
            host += inputs
            notes.append(
                f"offload: the layer inputs ({inputs / 2**30:.2f} GiB) wait in pinned host memory"
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
    max_dim = max(max(m, n) for _, m, n in projections(recipe))
    workspace = 4 * c * T * max_dim
    if (is_poet and bits in (4, 8)) or quantized:
        workspace += largest_mn * c  # a dequantized weight on the GEMM path
    if lowrank:  # dequantized/fp32 weight, gradient, update, noise of the largest weight
        opt_tmp = 4 * 4 * largest_mn
    else:  # torch AdamW foreach (the CPU) keeps a temporary the size of the largest group; the
        # fused CUDA step (poetxq.training.optim.adamw) and bitsandbytes keep none: conservative on
        # a GPU
        opt_tmp = max(q_bytes, params - q_bytes)
    merge_ws = 0
    if is_poet:  # fp32 R·W0·P of one layer and its gather into the new stored order
        merge_ws = max((3 if m % b or n % b else 2) * 4 * m * n for _, m, n in projections(recipe))
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
        seq_len=S, vocab_size=V, grad_accum=tc.grad_accum,
        gradient_checkpointing=tc.gradient_checkpointing,
        frozen_weights=frozen, buffers=buffers, trainable_params=params, gradients=grads,
        optimizer_states=states, activations=acts, logits=logits, workspace=workspace,
        optimizer_transient=opt_tmp, lm_head_grad=lm_head_grad, num_trainable=n_train,
        num_frozen=n_frozen, layer_activations=layer_full, head_activations=head,
        optimizer_in_backward=tc.optimizer_in_backward, in_backward_gradients=in_backward_grads,
        in_backward_transient=lm_head_grad if oc.state_bits == 32 else 0,
        offload_optimizer=tc.offload_optimizer, offload_transient=offload_tmp,
        offload_accumulator=offload_acc, offload_norms=offload_norms,
        host_optimizer=grads + states if tc.offload_optimizer else 0,
        host_offloaded=host, loss_chunk_tokens=tc.loss_chunk_tokens, notes=notes,
        merge_workspace=merge_ws,
        cuda_graph=graph and precision != "fp32",
    )  # fmt: skip
