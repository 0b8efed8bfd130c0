"""One AdamW for the low-rank baselines: GaLore, APOLLO, Q-GaLore, Q-APOLLO.

Papers: GaLore arXiv 2403.03507, APOLLO arXiv 2412.05270, Q-GaLore arXiv 2407.08296.

Every parameter group has a ``method``:

* ``"adamw"`` — plain AdamW (embeddings, ``lm_head``, norms in every baseline):
  ``m ← β1 m + (1−β1) g``, ``v ← β2 v + (1−β2) g²``, ``N = m̂ / (√v̂ + ε)`` with
  ``m̂ = m/(1−β1^t)``, ``v̂ = v/(1−β2^t)``; ``W ← W − lr·N``, then ``W ← W − lr·wd·W``.
* ``"galore"`` (arXiv 2403.03507) — for a 2-D gradient ``G`` [m, n] and rank ``r``
  (clamped to ``min(m, n)``): every ``gap`` steps (at t = 0, gap, 2·gap, …) take the SVD
  ``G = U S Vᵀ``; if ``m ≥ n`` the projector is ``P = Vᵀ[:r]`` [r, n] and ``R = G Pᵀ`` [m, r],
  otherwise ``P = U[:, :r]`` [m, r] and ``R = Pᵀ G`` [r, n]. Adam runs on ``R`` (``N`` as above)
  and the update is ``scale · N P`` (resp. ``scale · P N``).
  Q-GaLore (arXiv 2407.08296) adds: ``proj_bits = 4`` — ``P`` is stored as 4-bit group-wise codes
  (group ``proj_group_size``, round to nearest) and used dequantized; ``lazy`` — the cosine
  between the first singular vectors of consecutive SVDs is kept for the last ``queue_size``
  refreshes, and when the queue is full and its mean is ≥ ``cos_threshold`` the gap is multiplied
  by ``gamma_proj``; ``state_bits = 8`` — ``m`` and ``v`` are stored with bitsandbytes' blockwise
  8-bit quantization (block 256; signed dynamic map for ``m``, unsigned for ``v``), dequantized
  for the step and re-quantized after it.
* ``"apollo"`` (arXiv 2412.05270) — the same projection shape rule, but ``P`` is a Gaussian
  random matrix ``randn / √r`` ([r, n] or [m, r]) drawn from a generator seeded with
  :func:`apollo_projection_seed` (group ``seed``, the parameter's index, the refresh count),
  refreshed every ``gap`` steps. Adam runs on ``R``; the scaling factor is
  ``s = ‖N‖ / (‖R‖ + 1e-8)`` per channel (norms along the rank dimension: one factor per row of
  ``G`` if ``m ≥ n``, per column otherwise) or per tensor (``scale_type = "tensor"``,
  APOLLO-Mini). ``G̃ = G · s``; the norm-growth limiter (γ = ``norm_growth_limit``, 1.01) divides
  ``G̃`` by ``max(‖G̃‖ / ‖G̃_prev‖, γ) / γ`` from the second step on and remembers the limited
  norm. The update is ``√scale · G̃`` (the authors' code multiplies by √scale). For float
  weights (APOLLO) ``s`` and the limiter use the uncorrected ``m / (√v + ε)`` and ``G̃`` is
  multiplied by ``√(1−β2^t) / (1−β1^t)`` after the limiter, as ``apollo_torch.APOLLOAdamW``
  does; for quantized weights (Q-APOLLO) they use ``N``, as ``apollo_torch.QAPOLLOAdamW``
  (bitsandbytes' corrected Adam step) does. The two official optimizers differ there.

Weights are either float ``nn.Parameter`` (gradient in ``.grad``) or
:class:`~poetxq.baselines.qlinear.QuantLinear` codes (gradient in ``float_grad``). For the latter
the step dequantizes the weight, applies the update and weight decay in fp32 and re-quantizes it
in place with stochastic rounding; the rounding noise comes from the optimizer's own generator
(seeded with ``rounding_seed``), one ``torch.rand(weight.shape)`` per quantized weight in
parameter order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from poetxq.baselines.qlinear import (
    QuantLinear,
    dequantize_groupwise,
    pack_int4,
    quantize_groupwise,
    unpack_int4,
)

STATE_BLOCK = 256  # bitsandbytes' block size for 8-bit blockwise optimizer states

_LOWRANK_DEFAULTS: dict[str, Any] = {
    "rank": 128,
    "update_proj_gap": 200,
    "scale": 1.0,
    "scale_type": "channel",
    "norm_growth_limit": 1.01,
    "proj_bits": 32,
    "proj_group_size": 256,
    "lazy": False,
    "cos_threshold": 0.4,
    "gamma_proj": 2,
    "queue_size": 5,
    "state_bits": 32,
    "seed": 0,
}


def apollo_projection_seed(seed: int, index: int, refresh: int) -> int:
    """Generator seed of APOLLO's random projection for parameter ``index`` at its ``refresh``-th
    draw (0-based): ``(seed · 1_000_003 + index) · 65_537 + refresh`` modulo 2^62."""
    return ((seed * 1_000_003 + index) * 65_537 + refresh) % (1 << 62)


class _Blockwise8bit:
    """bitsandbytes blockwise 8-bit storage of one moment tensor (codes uint8 + absmax fp32).

    The quantization map (fp32 [256]) is copied to each device once and kept there: a copy from
    host memory per call is a blocking transfer (the host waits for the GPU's queue to drain), and
    the optimizer makes four such calls per matrix per step."""

    def __init__(self, signed: bool) -> None:
        import bitsandbytes.functional as bnbf

        self._f = bnbf
        self.code = bnbf.create_dynamic_map(signed=signed)
        self._codes: dict[torch.device, torch.Tensor] = {}

    def code_on(self, device: torch.device) -> torch.Tensor:
        """The quantization map on ``device`` (copied there at the first call only)."""
        code = self._codes.get(device)
        if code is None:
            code = self._codes[device] = self.code.to(device)
        return code

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, st = self._f.quantize_blockwise(
            x.contiguous(), code=self.code_on(x.device), blocksize=STATE_BLOCK
        )
        return q, st.absmax

    def dequantize(self, q: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
        return self._f.dequantize_blockwise(
            q, absmax=absmax, code=self.code_on(q.device), blocksize=STATE_BLOCK
        )


class LowRankAdamW(torch.optim.Optimizer):
    """AdamW with GaLore / APOLLO groups, over float or quantized weights (module docstring).

    Args:
        params: param groups (dicts with ``params`` and ``method`` in ``{"adamw", "galore",
            "apollo"}`` plus the low-rank keys of the module docstring; missing keys take
            ``_LOWRANK_DEFAULTS``). A quantized weight is given as its :class:`QuantLinear`'s
            ``weight`` parameter (uint8) and the module listed in ``quant_modules``.
        lr, betas, eps, weight_decay: AdamW hyperparameters (per-group overridable).
        quant_modules: every :class:`QuantLinear` whose ``weight`` is among ``params``.
        rounding_seed: seed of the stochastic-rounding noise generator.

    Raises:
        ValueError: unknown method, or a low-rank parameter that is not 2-D.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        quant_modules: Iterable[QuantLinear] = (),
        rounding_seed: int = 0,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "method": "adamw", **_LOWRANK_DEFAULTS}  # fmt: skip
        super().__init__(list(params), defaults)
        self._qmods = {id(m.weight): m for m in quant_modules}
        self._index: dict[int, int] = {}
        for group in self.param_groups:
            if group["method"] not in ("adamw", "galore", "apollo"):
                raise ValueError(f"unknown method {group['method']!r}")
            for p in group["params"]:
                self._index[id(p)] = len(self._index)
                if group["method"] != "adamw" and p.dim() != 2:
                    raise ValueError(f"low-rank methods need 2-D weights, got {tuple(p.shape)}")
        self._rounding_seed = rounding_seed
        self._gens: dict[torch.device, torch.Generator] = {}
        self._m8 = self._v8 = None

    # ------------------------------------------------------------------ gradients
    def gradient(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient of ``p``: ``float_grad`` of its :class:`QuantLinear`, else ``p.grad``."""
        q = self._qmods.get(id(p))
        return q.float_grad if q is not None else p.grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` of float params and ``float_grad`` of quantized weights."""
        super().zero_grad(set_to_none=set_to_none)
        for q in self._qmods.values():
            q.float_grad = None

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict()`` plus ``"rounding_generators"``: the state (uint8
        tensor) of the stochastic-rounding noise generator of each device type in use, so that a
        resumed run draws the same noise as an uninterrupted one."""
        out = super().state_dict()
        out["rounding_generators"] = {dev.type: gen.get_state() for dev, gen in self._gens.items()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`; the noise generators are re-created on the device of
        the quantized weights (e.g. a checkpoint from ``cuda:0`` loads on ``cuda:1``)."""
        state_dict = dict(state_dict)
        gens = state_dict.pop("rounding_generators", {})
        super().load_state_dict(state_dict)
        self._gens = {}
        devices = {q.weight.device for q in self._qmods.values()}
        for dev_type, gen_state in gens.items():
            for dev in devices:
                if dev.type == dev_type:
                    gen = torch.Generator(device=dev)
                    gen.set_state(gen_state.cpu())
                    self._gens[dev] = gen

    def _rounding_noise(self, w: torch.Tensor) -> torch.Tensor:
        gen = self._gens.get(w.device)
        if gen is None:
            gen = torch.Generator(device=w.device).manual_seed(self._rounding_seed)
            self._gens[w.device] = gen
        return torch.rand(w.shape, generator=gen, device=w.device)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                grad = self.gradient(p)
                if grad is None:
                    continue
                q = self._qmods.get(id(p))
                grad = grad.float()
                w = q.dequantize() if q is not None else p.detach().float()
                if group["method"] == "adamw":
                    update = self._adam(self.state[p], grad, group)
                else:
                    update = self._lowrank(p, grad, group)
                w = w - group["lr"] * update
                if group["weight_decay"] > 0:
                    w = w - group["lr"] * group["weight_decay"] * w
                if q is not None:
                    noise = self._rounding_noise(w) if q.stochastic_round else None
                    q.set_weight(w, noise)
                else:
                    p.copy_(w)
        return loss

    def _adam(
        self, state: dict, r: torch.Tensor, group: dict, *, corrected: bool = True
    ) -> torch.Tensor:
        """Adam direction ``N = m̂ / (√v̂ + ε)`` for gradient ``r`` (``corrected=False``: the
        uncorrected ``m / (√v + ε)``); updates the moments."""
        b1, b2 = group["betas"]
        eight = group["method"] != "adamw" and group["state_bits"] == 8
        if eight and self._m8 is None:  # also after load_state_dict
            self._m8, self._v8 = _Blockwise8bit(True), _Blockwise8bit(False)
        if "exp_avg" not in state:
            if eight:
                zero = torch.zeros_like(r)
                state["exp_avg"], state["exp_avg_absmax"] = self._m8.quantize(zero)
                state["exp_avg_sq"], state["exp_avg_sq_absmax"] = self._v8.quantize(zero)
            else:
                state["exp_avg"] = torch.zeros_like(r)
                state["exp_avg_sq"] = torch.zeros_like(r)
            state["step"] = 0
        state["step"] += 1
        t = state["step"]
        if eight:
            m = self._m8.dequantize(state["exp_avg"], state["exp_avg_absmax"])
            v = self._v8.dequantize(state["exp_avg_sq"], state["exp_avg_sq_absmax"])
        else:
            m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(b1).add_(r, alpha=1 - b1)
        v.mul_(b2).addcmul_(r, r, value=1 - b2)
        if corrected:
            n = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + group["eps"])
        else:
            n = m / (v.sqrt() + group["eps"])
        if eight:
            state["exp_avg"], state["exp_avg_absmax"] = self._m8.quantize(m)
            state["exp_avg_sq"], state["exp_avg_sq_absmax"] = self._v8.quantize(v)
        return n

    def _projector(self, state: dict) -> torch.Tensor:
        if "proj_codes" in state:
            shape = state["proj_shape"]
            codes = unpack_int4(state["proj_codes"], shape[0] * shape[1]).reshape(shape)
            return dequantize_groupwise(codes, state["proj_scales"], state["proj_zeros"],
                                        state["proj_group_size"])  # fmt: skip
        return state["proj"]

    def _refresh(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        m, n = grad.shape
        r = min(group["rank"], m, n)
        right = m >= n
        if group["method"] == "apollo":
            k = state.get("refreshes", 0)
            gen = torch.Generator().manual_seed(
                apollo_projection_seed(group["seed"], self._index[id(p)], k)
            )
            shape = (r, n) if right else (m, r)
            proj = (torch.randn(shape, generator=gen) / math.sqrt(r)).to(grad.device)
            state["proj"] = proj
            state["refreshes"] = k + 1
            return
        u, _s, vh = torch.linalg.svd(grad, full_matrices=False)
        proj = vh[:r].contiguous() if right else u[:, :r].contiguous()
        first = vh[0] if right else u[:, 0]
        if group["lazy"]:
            if "first_vector" in state:
                queue = state.setdefault("cos_queue", [])
                if len(queue) == group["queue_size"]:
                    queue.pop(0)
                queue.append(F.cosine_similarity(state["first_vector"], first, dim=0).item())
                if (
                    len(queue) == group["queue_size"]
                    and sum(queue) / len(queue) >= group["cos_threshold"]
                ):
                    state["gap"] = int(state["gap"] * group["gamma_proj"])
            state["first_vector"] = first.clone()
        state["refreshes"] = state.get("refreshes", 0) + 1
        if group["proj_bits"] == 4:
            codes, scales, zeros = quantize_groupwise(proj, group["proj_group_size"], 4)
            state["proj_codes"] = pack_int4(codes)
            state["proj_scales"], state["proj_zeros"] = scales, zeros
            state["proj_shape"] = tuple(proj.shape)
            state["proj_group_size"] = group["proj_group_size"]
        else:
            state["proj"] = proj

    def _lowrank(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> torch.Tensor:
        state = self.state[p]
        t = state.get("step", 0)  # steps taken so far
        state.setdefault("gap", group["update_proj_gap"])
        if "refreshes" not in state or t % state["gap"] == 0:
            self._refresh(p, grad, state, group)
        proj = self._projector(state)
        m, n = grad.shape
        right = m >= n
        low = grad @ proj.t() if right else proj.t() @ grad
        # apollo-torch's APOLLOAdamW (float weights) scales by the raw m / (√v + ε) and applies the
        # bias correction last, so its limiter compares uncorrected norms; its QAPOLLOAdamW
        # (quantized weights) takes bitsandbytes' corrected direction: each baseline follows its
        # own authors' code (tests/test_baselines_official.py)
        raw = group["method"] == "apollo" and id(p) not in self._qmods
        direction = self._adam(state, low, group, corrected=not raw)
        if group["method"] == "galore":
            back = direction @ proj if right else proj @ direction
            return group["scale"] * back
        if group["scale_type"] == "tensor":
            factor = direction.norm() / (low.norm() + 1e-8)
        else:
            dim = 1 if right else 0
            factor = direction.norm(dim=dim, keepdim=True) / (
                low.norm(dim=dim, keepdim=True) + 1e-8
            )
        scaled = grad * factor
        gamma = group["norm_growth_limit"]
        norm = scaled.norm()
        if "prev_norm" in state:
            limiter = torch.clamp(norm / (state["prev_norm"] + 1e-8), min=gamma) / gamma
            scaled = scaled / limiter
            state["prev_norm"] = norm / limiter
        else:
            state["prev_norm"] = norm
        if raw:
            b1, b2 = group["betas"]
            t = state["step"]
            scaled = scaled * (math.sqrt(1 - b2**t) / (1 - b1**t))
        return math.sqrt(group["scale"]) * scaled


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor held in ``optimizer.state`` (moments, projectors, step tensors, …)."""
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


@torch.no_grad()
def clip_grad_norm_all(
    params: Iterable[torch.Tensor], quant_modules: Iterable[QuantLinear], max_norm: float
) -> torch.Tensor:
    """``clip_grad_norm_`` over ``params``' ``.grad`` and the modules' ``float_grad`` together.

    Returns:
        The total L2 norm before clipping (fp32 scalar tensor).
    """
    grads = [p.grad for p in params if p.grad is not None]
    grads += [q.float_grad for q in quant_modules if q.float_grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def lowrank_parameter(module: nn.Module) -> torch.Tensor:
    """The tensor a low-rank group holds for ``module``: its ``weight`` (float or uint8 codes)."""
    return module.weight
