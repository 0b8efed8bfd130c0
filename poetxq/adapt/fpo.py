"""FPO pseudo-gradients of the target MLPs and the forward-only update step.

Paper: Patil, Dennis et al., arXiv 2608.14563 (FPO). For a target layer ``ℓ`` with SwiGLU MLP
``y = W3 · (silu(W1·x) ⊙ W2·x)`` (transformers: ``down_proj`` W3, ``gate_proj`` W1, ``up_proj``
W2), ``x`` the MLP's input (after the post-attention norm) and ``g̃`` the residual signal of
:func:`poetxq.adapt.signal.residual_signal`:

* ``∇W3 = g̃ᵀ · h_mid`` with ``h_mid = silu(a) ⊙ b``, ``a = W1·x``, ``b = W2·x`` (the update
  ``ΔW3 ∝ −g̃ᵀ·h_mid``);
* ``error_h = g̃ · W3_init`` (``W3_init``: W3 recorded when adaptation starts), then
  ``∇W1 = (error_h ⊙ b ⊙ silu'(a))ᵀ · x`` and ``∇W2 = (error_h ⊙ silu(a))ᵀ · x``.

These are the gradients of the surrogate ``⟨g̃, MLP_ℓ(x)⟩`` with ``g̃`` and ``x`` held fixed (the
"output-projection approximation": the signal reaching the MLP's output is taken to be ``g̃``, as
if every later block were the identity on the residual stream), with W3 frozen at ``W3_init`` in
the hidden-space error. For the last block they are the exact loss gradient at step 0.

Post-MLP norms (OLMo-2, Gemma 3: ``r ← r + norm_post(MLP(x))``): the signal at the MLP's output
is ``g̃ℓ = rmsnorm_vjp(o_ℓ, γ_post, ε, g̃)`` with ``o_ℓ`` the MLP output entering that norm
(cached by a hook), and ``g̃ℓ`` replaces ``g̃`` above — per layer, since ``o_ℓ`` differs. The
activation is SiLU (SwiGLU: Llama, Qwen, Mistral, OLMo-2) or tanh-approximated GELU (GeGLU:
Gemma 3), each with its exact derivative.

``a`` and ``b`` are cached by forward hooks on ``gate_proj`` / ``up_proj`` (the forward computes
them anyway); ``h_mid`` is recomputed from them in fp32 or wider. Nothing here builds an autograd
graph: the step runs under ``torch.no_grad`` and every parameter has ``requires_grad=False``.

Precision: the matmuls (the LM head's two in :func:`poetxq.adapt.signal.residual_signal`, the
four here) take their operands in the model's own dtype and return fp32, as autograd's matmuls
in a bf16 model do (tensor cores, fp32 accumulation); the element-wise parts (softmax, the RMSNorm
VJP, the SwiGLU derivatives) run in fp32 or wider. An fp32 or float64 model computes everything
in its own dtype. (In fp32 throughout, a 1B model's FPO step on an H200 spent two thirds of its
time in fp32 GEMMs without tensor cores and ran no faster than full fine-tuning.)

Choices where the paper is not explicit (documented and tested):

* relative clipping at ``clip`` (1 %) is per tensor, on the *update* by default: after the
  optimizer forms ``ΔW`` (including AdamW's decoupled decay), ``ΔW`` is scaled so
  ``‖ΔW‖_F ≤ clip·‖W‖_F``. With AdamW a gradient-norm clip would be almost cancelled by the
  second-moment normalisation, while the update clip bounds every step's relative change for
  both optimizers. ``clip_on="grad"`` clips the gradient instead (``‖∇W‖_F ≤ clip·‖W‖_F``).
* the optimizers follow ``torch.optim.AdamW`` (bias-corrected, decoupled decay) and
  ``torch.optim.SGD`` (momentum buffer starts at the first gradient, no dampening) exactly, on
  fp32 master copies of the target weights only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from poetxq.adapt.signal import norm_eps, norm_gain, residual_signal, rmsnorm_vjp
from poetxq.model.pretrained import LLAMA_FAMILY

#: the MLP projections FPO adapts, in the order W1 (gate), W2 (up), W3 (down)
MLP_PROJS: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")

#: model types with a norm after the MLP (``post_feedforward_layernorm``), whose VJP FPO applies
POST_MLP_NORM: tuple[str, ...] = ("olmo2", "gemma3_text")

#: the transformers ``model_type`` values FPO supports: the Llama family and the post-norm ones
FPO_FAMILY: tuple[str, ...] = LLAMA_FAMILY + POST_MLP_NORM

_GELU_C = math.sqrt(2.0 / math.pi)


def _silu(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sig = torch.sigmoid(a)
    return a * sig, sig * (1 + a * (1 - sig))


def _gelu_tanh(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # gelu(a) = a/2 · (1 + tanh(u)), u = √(2/π)(a + 0.044715 a³)
    t = torch.tanh(_GELU_C * (a + 0.044715 * a.pow(3)))
    d_u = _GELU_C * (1 + 3 * 0.044715 * a.pow(2))
    return 0.5 * a * (1 + t), 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * d_u


#: the MLP activations FPO knows (transformers' names): ``act(a) -> (value, derivative)``
ACTIVATIONS: dict[str, Any] = {"silu": _silu, "gelu_pytorch_tanh": _gelu_tanh}


class FPOError(ValueError):
    """A model, layer list or setting FPO cannot use; the message is one line naming the fix."""


@dataclass
class LlamaParts:
    """The pieces of a transformers Llama-family causal LM that FPO touches."""

    base: nn.Module  # model.model: embeddings, layers, final norm
    layers: nn.ModuleList  # the decoder blocks
    norm: nn.Module  # final RMSNorm
    lm_weight: torch.Tensor  # [V, D], the LM head's weight (the embedding when tied)
    act: str = "silu"  # the MLP activation (a key of ACTIVATIONS)
    post_norms: list[nn.Module] | None = None  # per layer, the norm after the MLP (OLMo-2, Gemma 3)


def llama_parts(model: nn.Module) -> LlamaParts:
    """Check ``model`` is a causal LM FPO supports and return its parts.

    Supported: transformers ``model_type`` in :data:`FPO_FAMILY` — the Llama family (no norm
    after the MLP) and OLMo-2 / Gemma 3 text models (``post_feedforward_layernorm``, whose VJP
    is applied per layer), with a gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, no
    biases) whose activation is in :data:`ACTIVATIONS`.

    Raises:
        FPOError: another model type, an unknown MLP activation, MLP biases, an LM head with a
            bias, or final-logit soft-capping (Gemma 2 style; its Jacobian is not implemented).
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FPO_FAMILY:
        raise FPOError(f"FPO supports {', '.join(FPO_FAMILY)} models, not {model_type!r}")
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if act not in ACTIVATIONS or getattr(config, "mlp_bias", False):
        raise FPOError(
            f"FPO needs a bias-free gated MLP with activation {' or '.join(ACTIVATIONS)}; this "
            f"model has {act!r}{' with biases' if getattr(config, 'mlp_bias', False) else ''}"
        )
    if getattr(config, "final_logit_softcapping", None):
        raise FPOError("FPO does not support final-logit soft-capping (final_logit_softcapping)")
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise FPOError("FPO needs an LM head without a bias")
    base = model.model
    post = None
    if model_type in POST_MLP_NORM:
        post = [layer.post_feedforward_layernorm for layer in base.layers]
    return LlamaParts(base, base.layers, base.norm, head.weight, act, post)


def check_layers(layers: Sequence[int], n_layers: int) -> list[int]:
    """Sorted unique layer indices, negatives counted from the end (``-1``: the last block).

    Raises:
        FPOError: an empty list or an index outside ``[-n_layers, n_layers)``.
    """
    if not layers:
        raise FPOError("no target layer given")
    out = set()
    for i in layers:
        if not -n_layers <= i < n_layers:
            raise FPOError(f"layer {i} does not exist: the model has {n_layers} layers")
        out.add(i % n_layers)
    return sorted(out)


class ActivationCache:
    """Forward hooks that keep what FPO needs from one forward pass (a context manager).

    Stored (detached, as produced): ``hidden`` — the final norm's input ``[B, L, D]``; per target
    layer ``i``: ``x[i]`` — the MLP input ``[B, L, D]``, ``a[i]`` / ``b[i]`` — the ``gate_proj`` /
    ``up_proj`` outputs ``[B, L, F]``, and with post-MLP norms ``o[i]`` — the MLP output
    ``[B, L, D]`` entering that norm. Each forward overwrites them; leaving the context removes
    the hooks.
    """

    def __init__(self, parts: LlamaParts, layers: Sequence[int]) -> None:
        self.parts, self.layers = parts, list(layers)
        self.hidden: torch.Tensor | None = None
        self.x: dict[int, torch.Tensor] = {}
        self.a: dict[int, torch.Tensor] = {}
        self.b: dict[int, torch.Tensor] = {}
        self.o: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> ActivationCache:
        def keep(store: dict[int, torch.Tensor], i: int, pre: bool) -> Any:
            def hook(_mod: nn.Module, args: tuple, out: Any = None) -> None:
                store[i] = (args[0] if pre else out).detach()

            return hook

        def keep_hidden(_mod: nn.Module, args: tuple) -> None:
            self.hidden = args[0].detach()

        self._handles.append(self.parts.norm.register_forward_pre_hook(keep_hidden))
        for i in self.layers:
            mlp = self.parts.layers[i].mlp
            self._handles += [
                mlp.register_forward_pre_hook(keep(self.x, i, True)),
                mlp.gate_proj.register_forward_hook(keep(self.a, i, False)),
                mlp.up_proj.register_forward_hook(keep(self.b, i, False)),
            ]
            if self.parts.post_norms is not None:
                post = self.parts.post_norms[i]
                self._handles.append(post.register_forward_pre_hook(keep(self.o, i, True)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def mlp_pseudo_grads(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g_tilde: torch.Tensor,
    w3_init: torch.Tensor,
    act: str = "silu",
) -> dict[str, torch.Tensor]:
    """FPO pseudo-gradients of one gated MLP (see the module docstring for the formulas).

    Args:
        x: the MLP input ``[B, L, D]``.
        a: ``gate_proj`` output ``W1·x`` ``[B, L, F]``.
        b: ``up_proj`` output ``W2·x`` ``[B, L, F]``.
        g_tilde: the residual signal ``g̃`` ``[B, L, D]`` (already divided by the token count).
        w3_init: ``down_proj`` weight at the start of adaptation ``[D, F]``.
        act: the activation, a key of :data:`ACTIVATIONS` (``silu``: SwiGLU, ``gelu_pytorch_tanh``:
            GeGLU), applied to ``a`` in ``act(a) ⊙ b``.

    Returns:
        ``{"gate_proj": ∇W1 [F, D], "up_proj": ∇W2 [F, D], "down_proj": ∇W3 [D, F]}`` in
        ``promote(g_tilde.dtype, fp32)``; the gradient of ``⟨g̃, MLP(x)⟩`` (descent: ``−∇``).

    Raises:
        ValueError: shapes that do not fit together, or an unknown ``act``.
    """
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown activation {act!r}; known: {', '.join(ACTIVATIONS)}")
    d, f = x.shape[-1], a.shape[-1]
    if g_tilde.shape != x.shape or a.shape != b.shape or w3_init.shape != (d, f):
        raise ValueError(
            f"shapes do not fit: x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
            f"g_tilde {tuple(g_tilde.shape)}, w3_init {tuple(w3_init.shape)}"
        )
    dtype = torch.promote_types(g_tilde.dtype, torch.float32)
    gemm = x.dtype  # the matmuls' operands: the model's own precision (module docstring)

    def mm(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return (p.to(gemm) @ q.to(gemm)).to(dtype)

    g = g_tilde.reshape(-1, d).to(dtype)
    x2 = x.reshape(-1, d)
    a2, b2 = a.reshape(-1, f).to(dtype), b.reshape(-1, f).to(dtype)
    value, slope = ACTIVATIONS[act](a2)
    error_h = mm(g, w3_init)  # [N, F]: the error at h_mid through W3_init
    return {
        "gate_proj": mm((error_h * b2 * slope).T, x2),
        "up_proj": mm((error_h * value).T, x2),
        "down_proj": mm(g.T, value * b2),
    }


def layer_pseudo_grads(
    parts: LlamaParts,
    cache: ActivationCache,
    i: int,
    g_tilde: torch.Tensor,
    w3_init: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The pseudo-gradients of layer ``i``'s MLP from one cached forward pass.

    ``g̃`` is taken through the layer's post-MLP norm first when the model has one
    (``rmsnorm_vjp(o_i, γ_post, ε, g̃)``, module docstring), then :func:`mlp_pseudo_grads` with
    the model's activation.

    Args:
        parts: the model's parts (:func:`llama_parts`).
        cache: an :class:`ActivationCache` that recorded layer ``i``.
        i: the layer index (``0 ≤ i < n_layers``).
        g_tilde: the residual signal ``[B, L, D]`` (:func:`residual_signal`).
        w3_init: ``down_proj``'s weight at the start of adaptation ``[D, F]``.

    Returns:
        As :func:`mlp_pseudo_grads`.
    """
    if parts.post_norms is not None:
        post = parts.post_norms[i]
        g_tilde = rmsnorm_vjp(cache.o[i], norm_gain(post), norm_eps(post), g_tilde)
    return mlp_pseudo_grads(cache.x[i], cache.a[i], cache.b[i], g_tilde, w3_init, parts.act)


@dataclass
class StepStats:
    """What one :meth:`FPOAdapter.step` reports."""

    loss: float  # mean cross-entropy before the update (nats)
    n_tokens: int  # labelled positions
    clipped: int  # target tensors whose update (or gradient) the relative clip scaled down


class FPOAdapter:
    """Forward-only adaptation of the MLPs of ``layers`` (paper: arXiv 2608.14563, FPO).

    On construction every parameter of ``model`` gets ``requires_grad=False``; the target
    weights (``gate_proj``, ``up_proj``, ``down_proj`` of each target layer) get fp32 master
    copies (the weight itself when it is already fp32) and optimizer state; ``W3_init`` is
    recorded. :meth:`step` runs one forward pass with hooks, computes ``g̃`` once (Llama-family:
    the same for every target layer) and each target's pseudo-gradient, and updates the masters
    and, from them, the model's weights. Non-target parameters never change.

    Args:
        model: a transformers Llama-family causal LM (:func:`llama_parts`).
        layers: target layer indices (negatives from the end).
        lr: learning rate.
        optimizer: ``"adamw"`` (``betas``, ``eps``, decoupled ``weight_decay``, default 0.01) or
            ``"sgd"`` (``momentum`` 0.9; ``weight_decay`` added to the gradient as
            ``torch.optim.SGD`` does).
        weight_decay: see ``optimizer``; None: 0.01 for AdamW, 0 for SGD.
        clip: relative clip ``c`` (0.01 = 1 %); None or 0 disables it.
        clip_on: ``"update"`` (``‖ΔW‖ ≤ c‖W‖``) or ``"grad"`` (``‖∇W‖ ≤ c‖W‖``), per tensor.
        chunk_tokens: positions per chunk of the output error (:func:`residual_signal`).

    Raises:
        FPOError: an unsupported model, bad layers, a non-positive ``lr`` or an unknown
            ``optimizer`` / ``clip_on``.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[int],
        *,
        lr: float,
        optimizer: Literal["adamw", "sgd"] = "adamw",
        weight_decay: float | None = None,
        momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        clip: float | None = 0.01,
        clip_on: Literal["update", "grad"] = "update",
        chunk_tokens: int = 2048,
    ) -> None:
        if optimizer not in ("adamw", "sgd") or clip_on not in ("update", "grad"):
            raise FPOError(f"unknown optimizer {optimizer!r} or clip_on {clip_on!r}")
        if not lr > 0:
            raise FPOError(f"the learning rate must be positive, got {lr}")
        self.model, self.parts = model, llama_parts(model)
        self.layers = check_layers(layers, len(self.parts.layers))
        self.lr, self.optimizer, self.momentum = lr, optimizer, momentum
        if weight_decay is None:
            weight_decay = 0.01 if optimizer == "adamw" else 0.0
        self.weight_decay = weight_decay
        self.betas, self.eps, self.clip, self.clip_on = betas, eps, clip or 0.0, clip_on
        self.chunk_tokens, self.steps = chunk_tokens, 0
        for p in model.parameters():
            p.requires_grad_(False)
        self.params: dict[tuple[int, str], nn.Parameter] = {}
        self.masters: dict[tuple[int, str], torch.Tensor] = {}
        self.state: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self.w3_init: dict[int, torch.Tensor] = {}
        for i in self.layers:
            mlp = self.parts.layers[i].mlp
            self.w3_init[i] = mlp.down_proj.weight.detach().clone()
            for name in MLP_PROJS:
                p = getattr(mlp, name).weight
                self.params[i, name] = p
                self.masters[i, name] = p.data if p.dtype == torch.float32 else p.data.float()
                self.state[i, name] = {}

    def target_numel(self) -> int:
        """Number of adapted weights (elements of the target matrices)."""
        return sum(p.numel() for p in self.params.values())

    def trained(self) -> str:
        """What this adapter trains, for the start line: the target layers' MLPs."""
        return f"the MLPs of layers {','.join(map(str, self.layers))}"

    @torch.no_grad()
    def pseudo_grads(
        self, input_ids: torch.Tensor, labels: torch.Tensor
    ) -> tuple[dict[tuple[int, str], torch.Tensor], StepStats]:
        """One forward pass and the pseudo-gradient of every target (no update, no graph).

        Args:
            input_ids: ``[B, L]`` int64.
            labels: ``[B, L]`` int64 next-token targets (``-100``: none).

        Returns:
            ``({(layer, proj): ∇W}, stats)`` with ``∇W`` fp32 (or wider), shaped like the weight.
        """
        with ActivationCache(self.parts, self.layers) as cache:
            self.parts.base(input_ids=input_ids, use_cache=False)
        assert cache.hidden is not None
        signal = residual_signal(
            cache.hidden, self.parts.norm, self.parts.lm_weight, labels,
            chunk_tokens=self.chunk_tokens,
        )  # fmt: skip
        grads = {}
        for i in self.layers:
            per = layer_pseudo_grads(self.parts, cache, i, signal.g_tilde, self.w3_init[i])
            grads.update({(i, name): g for name, g in per.items()})
        return grads, StepStats(signal.loss, signal.n_tokens, 0)

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> StepStats:
        """One FPO step: pseudo-gradients (:meth:`pseudo_grads`), optimizer, clip, weights.

        Host synchronizations (on a GPU): those of :meth:`pseudo_grads` (FPO: two, see
        :func:`residual_signal`) and one at the end that reads the number of clipped tensors
        (none when the clip is off): the clip itself is decided on the device.

        Returns:
            :class:`StepStats` (loss before the update, tokens, tensors clipped).
        """
        grads, stats = self.pseudo_grads(input_ids, labels)
        self.steps += 1
        clipped: list[torch.Tensor] = []
        for key, grad in grads.items():
            flag = self._update(key, grad.to(torch.float32))
            if flag is not None:
                clipped.append(flag)
        if clipped:
            stats.clipped += int(torch.stack(clipped).sum())
        return stats

    def _relative_scale(self, norm: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """Factor ``≤ 1`` that brings ``norm`` to at most ``clip · ref``, as a float64 0-d tensor
        on their device (no host synchronization).

        Computed in float64 from the two fp32 norms: ``limit = clip · ref``, and ``limit / norm``
        where ``norm > limit``, else exactly 1 — the same double arithmetic as Python floats.
        Only called with the clip on.
        """
        limit = ref.to(torch.float64) * self.clip
        norm = norm.to(torch.float64)
        return torch.where(norm > limit, limit / norm, 1.0)

    def _clip(self, value: torch.Tensor, master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``value`` scaled so ``‖value‖_F ≤ clip·‖master‖_F`` (a new tensor; multiplied by
        exactly 1 when within the bound, which leaves it unchanged), and a 0-d bool tensor that
        is True when it was scaled down."""
        scale = self._relative_scale(value.norm(), master.norm())
        return value * scale.to(value.dtype), scale < 1.0

    def _update(self, key: tuple[int, str], grad: torch.Tensor) -> torch.Tensor | None:
        """Optimizer step, clip and weight copy of one target; returns the 0-d bool "clipped"
        tensor (None when the clip is off)."""
        master, state = self.masters[key], self.state[key]
        clipped = None
        if self.clip > 0 and self.clip_on == "grad":
            grad, clipped = self._clip(grad, master)
        if self.optimizer == "adamw":
            b1, b2 = self.betas
            m = state.setdefault("exp_avg", torch.zeros_like(master))
            v = state.setdefault("exp_avg_sq", torch.zeros_like(master))
            m.lerp_(grad, 1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            denom = (v.sqrt() / (1 - b2**self.steps) ** 0.5).add_(self.eps)
            delta = m / denom * (-self.lr / (1 - b1**self.steps))
            delta.add_(master, alpha=-self.lr * self.weight_decay)
        else:
            if self.weight_decay:
                grad = grad.add(master, alpha=self.weight_decay)
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.clone()
            else:
                buf.mul_(self.momentum).add_(grad)
            delta = buf * -self.lr
        if self.clip > 0 and self.clip_on == "update":
            delta, clipped = self._clip(delta, master)
        master.add_(delta)
        param = self.params[key]
        if param.data.data_ptr() != master.data_ptr():
            param.data.copy_(master)
        return clipped
