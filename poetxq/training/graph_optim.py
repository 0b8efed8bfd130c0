"""The optimizer step inside a CUDA graph's backward (``train.optimizer_in_backward`` together
with ``train.cuda_graph: true``).

:class:`poetxq.training.lowmem.OptimizerInBackward` updates each parameter from a
post-accumulate-grad hook and frees its gradient at once: under activation checkpointing at most one
decoder layer's gradients are alive, which is what brings a Llama-8B step under 11 GiB. A CUDA graph
(:mod:`poetxq.training.cudagraph`) makes the same step 1.5–2× faster, but it replays kernels with
the arguments they were captured with, and bitsandbytes' 8-bit update takes the learning rate and
the step count ``t`` as host scalars: a replay would apply the first step's values forever. So
until now the graph kept every gradient as a static tensor (1.16 GiB at Llama-8B) and ran the
optimizer after the replay.

:class:`GraphedInBackward` keeps the hooks but makes them graph-safe:

* the 8-bit moments are updated by :func:`quant_kernels.adam8bit.adam8bit_update_device_scalars`
  (bitsandbytes' blockwise 8-bit AdamW rule and state format), which reads ``(lr, β1ᵗ, β2ᵗ)``
  from a row of :attr:`GraphedInBackward.scalars` when it runs; moments kept in fp32 (tensors
  below bitsandbytes' ``min_8bit_size``) by a few torch ops that read the same row;
* :meth:`GraphedInBackward.before_replay` writes every row (one host→device copy per step) from
  the param groups' current learning rates and each parameter's step count, which it keeps in
  the optimizer's ``state`` as bitsandbytes does (``state_dict`` and checkpoints unchanged);
* the state tensors the graph writes are made once, before the capture
  (:meth:`GraphedInBackward.prepare`), and never replaced: a state that was dropped (the reset of
  ``Q``'s moments after a merge, :func:`poetxq.training.optim.reset_orthogonal_state`) is zeroed in
  place, one that was replaced (``load_state_dict``) is copied in;
* the LM head's gradient is never made whole:
  :class:`poetxq.training.loss.ChunkedLinearCrossEntropy` hands it over a slice of rows at a time
  (:func:`poetxq.training.loss.register_row_update`), each slice complete, and the slice's rows and
  moment blocks are updated at once (0.31 GiB less at the start of a Llama-13B backward); an update
  of rows is the whole-tensor update restricted to them, since every 8-bit state block (256
  elements) lies within one slice;
* during the eager warm-up passes before the capture the hooks only *rehearse*: each update runs
  on the real tensors, so that Triton compiles exactly the kernel variants the capture will
  launch (it specializes on pointer alignment, and a state view inside a flat buffer need not be
  aligned as a fresh copy is), and the values saved on the host before are written back; the
  parameters and states end up unchanged.

The gradients are then ordinary tensors of the graph's private pool, freed right after their
update, as in an eager backward. The update is the same rule as the eager
``optimizer_in_backward`` path (bitsandbytes' CUDA op there): results agree up to the rounding
of a few state codes, as :func:`poetxq.training.optim.adamw8bit_class`'s flat update does.

Needs: the run's optimizer is :func:`poetxq.training.optim.adamw8bit_class` (``optim.state_bits:
8``, the POET methods), on CUDA; one backward per step and no gradient clipping (as the eager path).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from poetxq.model.flat import BNB_STATE_BLOCK as BLOCK  # elements per 8-bit state block
from poetxq.training.loss import register_row_update
from poetxq.training.lowmem import OptimizerInBackward
from poetxq.training.optim import bnb_ensure_state


class GraphedInBackward:
    """Per-parameter 8-bit AdamW updates during backward that a CUDA graph can replay.

    Args:
        optimizer: the run's :func:`poetxq.training.optim.adamw8bit_class` instance (bitsandbytes'
            ``AdamW8bit`` rule, not paged); its parameters are on CUDA (or on the CPU under
            Triton's interpreter, ``TRITON_INTERPRET=1``, for tests).

    Attributes:
        scalars: ``[num_params, 3]`` fp32 on the parameters' device: ``(lr, β1ᵗ, β2ᵗ)`` per
            hooked parameter, rewritten by :meth:`before_replay`.
        updated: hook calls that updated a parameter (not rehearsals) since the last
            :meth:`reset_count`; a capture that recorded none captured no update.
        active: the parameters (by ``id``) whose update the capture recorded (set by the first
            :meth:`reset_count` that follows updates; ``None`` before): only their step counts
            advance, as bitsandbytes advances only the parameters that get a gradient.

    Raises:
        ValueError: not a bitsandbytes 8-bit Adam optimizer (or a paged one), or parameters on
            more than one device (one line, naming the fix).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        name = getattr(optimizer, "optimizer_name", None)
        if name != "adam" or getattr(optimizer, "is_paged", False):
            raise ValueError(
                "train.optimizer_in_backward inside a CUDA graph needs the 8-bit AdamW of the "
                f"POET methods (optim.state_bits: 8), not {type(optimizer).__name__}; set "
                "train.cuda_graph: false"
            )
        self.optimizer = optimizer
        self.params: list[nn.Parameter] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (group index, index in it)
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.requires_grad:
                    self._where[id(p)] = (gi, pi)
                    self.params.append(p)
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise ValueError(
                f"train.optimizer_in_backward inside a CUDA graph needs every trainable "
                f"parameter on one device, got {sorted(map(str, devices))}"
            )
        self._row = {id(p): i for i, p in enumerate(self.params)}
        self.scalars = torch.zeros(len(self.params), 3, dtype=torch.float32, device=devices.pop())
        self._owned: dict[int, dict[str, Any]] = {}  # id(param) -> the state the graph writes
        self._rehearsing = False
        self.updated = 0
        self._updated_ids: set[int] = set()
        self.active: set[int] | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        # every matrix (the chunked loss asks only for the LM head's weight)
        self._sliced = [p for p in self.params if p.dim() == 2]
        for p in self._sliced:
            register_row_update(p, _Rows(self, p))

    # -- before the capture ------------------------------------------------------------------

    def prepare(self) -> None:
        """Create every parameter's optimizer state now (zero, or as loaded), in the tensors the
        captured kernels will write; call once, before the warm-up and the capture.

        Raises:
            ValueError: a state bitsandbytes keeps in a form the graph cannot update
                (``max_unorm`` or a per-parameter override of the optimizer's bits).
        """
        opt: Any = self.optimizer
        for gi, flat in getattr(opt, "_flat", {}).items():  # flattened groups: one state buffer
            if flat.intact():
                opt._gather_state(gi, flat)
        for p in self.params:
            if not p.is_contiguous():  # as bitsandbytes' update_step does: the kernels read
                p.data = p.data.contiguous()  # parameters as flat arrays
            gi, pi = self._where[id(p)]
            bnb_ensure_state(opt, gi, pi, p)
            state = opt.state[p]
            config = opt.get_config(gi, pi, opt.param_groups[gi])
            if config["max_unorm"] > 0.0 or state["state1"].dtype not in (
                torch.uint8,
                torch.float32,
            ):
                raise ValueError(
                    "train.optimizer_in_backward inside a CUDA graph updates plain 8-bit AdamW "
                    "states only (no max_unorm, no per-parameter overrides); set "
                    "train.cuda_graph: false"
                )
            self._owned[id(p)] = state

    @contextlib.contextmanager
    def rehearsal(self) -> Iterator[None]:
        """While active, the hooks run every update (compiling its kernel variant) and then
        write the parameter and moments saved on the host back: nothing changes; gradients are
        still freed."""
        self._rehearsing = True
        try:
            yield
        finally:
            self._rehearsing = False

    # -- each step -----------------------------------------------------------------------------

    @torch.no_grad()
    def before_replay(self) -> None:
        """Advance the step count of every parameter the replay updates (:attr:`active`) and
        write ``(lr, β1ᵗ, β2ᵗ)`` into :attr:`scalars` for the next replay (the learning rate
        each group holds now, as set by the LR scheduler). A state dropped since the last step
        restarts at zero in place; one replaced by ``load_state_dict`` is copied into the
        graph's tensors."""
        opt: Any = self.optimizer
        rows = []
        for p in self.params:
            mine = self._owned[id(p)]
            current = opt.state.get(p)
            if current is not mine:
                self._adopt(p, mine, current)
            if self.active is not None and id(p) not in self.active:
                rows.append((0.0, 0.0, 0.0))  # never read: its update is not in the graph
                continue
            mine["step"] += 1
            gi, pi = self._where[id(p)]
            config = opt.get_config(gi, pi, opt.param_groups[gi])
            beta1, beta2 = config["betas"][:2]
            t = mine["step"]
            rows.append((config["lr"], beta1**t, beta2**t))
        host = torch.tensor(rows, dtype=torch.float64).to(torch.float32)
        if self.scalars.is_cuda:
            host = host.pin_memory()
        self.scalars.copy_(host, non_blocking=True)

    def after_replay(self) -> None:
        """Tell autograd (and :mod:`poetxq.model.blockcache`'s version checks) that the replay
        changed every parameter in place."""
        torch.autograd.graph.increment_version(self.params)

    def _adopt(self, p: torch.Tensor, mine: dict[str, Any], current: dict | None) -> None:
        """Make ``mine`` (the tensors the graph writes) ``p``'s state again: zero when the
        state was dropped, else a copy of ``current``'s values."""
        if not current:  # dropped: bitsandbytes would start it afresh at zero
            for key in _MOMENTS:
                if key in mine:
                    mine[key].zero_()
            mine["step"] = 0
        else:
            for key in _MOMENTS:
                if key in mine:
                    if key not in current or current[key].numel() != mine[key].numel():
                        raise ValueError(
                            f"the loaded optimizer state of a {tuple(p.shape)} parameter does "
                            "not match the one the CUDA graph was captured with; resume with "
                            "the same optim.state_bits"
                        )
                    mine[key].copy_(current[key].reshape(mine[key].shape))
            mine["step"] = int(current["step"])
        self.optimizer.state[p] = mine

    # -- the hook ------------------------------------------------------------------------------

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        grad = p.grad
        p.grad = None
        if grad is None:
            return
        self.update_elements(p, 0, p.numel(), grad)

    @torch.no_grad()
    def update_elements(self, p: torch.Tensor, lo: int, hi: int, grad: torch.Tensor) -> None:
        """Apply the step to the flat elements ``[lo, hi)`` of ``p`` (its gradient there:
        ``grad``, ``hi − lo`` elements); ``lo`` and, unless it is ``p.numel()``, ``hi`` are
        multiples of the 8-bit state block (256). The parameter counts as updated when ``hi``
        is its end. Rehearsals write the old values back (see :meth:`rehearsal`).

        Raises:
            RuntimeError: :meth:`prepare` was not called.
            ValueError: ``[lo, hi)`` cuts an 8-bit state block.
        """
        state = self._owned.get(id(p))
        if state is None:
            raise RuntimeError("GraphedInBackward.prepare() was not called before the backward")
        n = p.numel()
        if not 0 <= lo < hi <= n or lo % BLOCK or (hi != n and hi % BLOCK):
            raise ValueError(f"elements [{lo}, {hi}) of a {n}-element parameter cut an 8-bit "
                             f"state block of {BLOCK}")  # fmt: skip
        gi, pi = self._where[id(p)]
        opt: Any = self.optimizer
        config = opt.get_config(gi, pi, opt.param_groups[gi])
        row = self.scalars[self._row[id(p)]]
        part = _part(state, lo, hi)
        flat_p = p.detach().view(-1)[lo:hi]  # contiguous (prepare made every parameter so)
        if self._rehearsing:  # on the real tensors (their alignment), then written back;
            # the saved copies wait on the host: on the device the embeddings' (0.65 GB at
            # Llama-13B) would raise the first step's peak above the steady state's
            saved = {k: v.to("cpu", copy=True) for k, v in part.items() if k in _MOMENTS}
            saved_p = flat_p.to("cpu", copy=True)
            _update(flat_p, grad, part, config, row)
            flat_p.copy_(saved_p)
            for k, v in saved.items():
                part[k].copy_(v)
            return
        _update(flat_p, grad, part, config, row)
        if hi == n:
            self.updated += 1
            self._updated_ids.add(id(p))

    def reset_count(self) -> int:
        """The number of parameter updates since the last call; resets it to 0. The first
        call after updates (the capture's) fixes :attr:`active`."""
        n, self.updated = self.updated, 0
        if self._updated_ids and self.active is None:
            self.active = set(self._updated_ids)
        self._updated_ids.clear()
        return n

    def remove(self) -> None:
        """Detach the hooks (later backwards leave gradients in ``.grad`` again)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for p in self._sliced:
            register_row_update(p, None)
        self._sliced.clear()


class _Rows:
    """:class:`poetxq.training.loss.RowUpdate` of one 2-D parameter: rows → flat elements."""

    def __init__(self, hooks: GraphedInBackward, p: torch.Tensor) -> None:
        self._hooks = weakref.ref(hooks)  # the loss's registry must not keep the hooks alive
        d = p.shape[1]
        self.row_align = BLOCK // math.gcd(d, BLOCK)  # a slice starts on a state block

    def __call__(self, weight: torch.Tensor, start: int, end: int, grad: torch.Tensor) -> None:
        hooks = self._hooks()
        if hooks is None:
            raise RuntimeError("the GraphedInBackward of this row update no longer exists")
        d = weight.shape[1]
        hooks.update_elements(weight, start * d, end * d, grad.reshape(-1))


def _part(state: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """``state``'s moments restricted to the flat elements ``[lo, hi)`` (views; 8-bit states
    with their ``absmax`` blocks; ``lo`` on a block boundary), other entries as they are."""
    part = dict(state)
    part["state1"] = state["state1"].view(-1)[lo:hi]
    part["state2"] = state["state2"].view(-1)[lo:hi]
    if state["state1"].dtype == torch.uint8:
        b0, b1 = lo // BLOCK, -(-hi // BLOCK)
        part["absmax1"] = state["absmax1"].view(-1)[b0:b1]
        part["absmax2"] = state["absmax2"].view(-1)[b0:b1]
    return part


#: the state entries an update rewrites (saved and written back by a rehearsal)
_MOMENTS = ("state1", "state2", "absmax1", "absmax2")


def _one_minus_fp32(beta: float) -> float:
    """``1 − β`` computed in fp32 from fp32 ``β``."""
    one, b = torch.tensor(1.0, dtype=torch.float32), torch.tensor(beta, dtype=torch.float32)
    return float(one - b)


def _update(
    flat_p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    config: dict,
    row: torch.Tensor,
) -> None:
    """One AdamW step of the flat contiguous ``flat_p`` with the state's moments (as long as
    ``flat_p``; see :func:`_part`) and ``row = (lr, β1ᵗ, β2ᵗ)``."""
    from quant_kernels.adam8bit import adam8bit_update_device_scalars

    beta1, beta2 = config["betas"][:2]
    eps, wd = config["eps"], config["weight_decay"]
    g = grad.reshape(-1).contiguous()
    if state["state1"].dtype == torch.uint8:
        adam8bit_update_device_scalars(
            g, flat_p, state["state1"].view(-1), state["state2"].view(-1), beta1, beta2, eps,
            row, state["qmap1"], state["qmap2"], state["absmax1"], state["absmax2"], wd,
        )  # fmt: skip
        return
    # fp32 moments (a tensor below min_8bit_size): bitsandbytes' 32-bit Adam rule,
    # p ← p − lr·√(1−β2ᵗ)/(1−β1ᵗ) · m / (√v + eps·√(1−β2ᵗ)), then p ← p·(1 − lr·wd) as its CUDA
    # kernel orders them (its CPU op decays first; so do we on a CPU); 1 − β in fp32 as its
    # kernel computes it (in float64, 1 − β2 differs by 1.3e-5 relative)
    m, v = state["state1"].view(-1), state["state2"].view(-1)
    g32 = g.float()
    m.mul_(beta1).add_(g32, alpha=_one_minus_fp32(beta1))
    v.mul_(beta2).addcmul_(g32, g32, value=_one_minus_fp32(beta2))
    lr = row[0]
    sqrt_c2 = (1.0 - row[2]).sqrt()
    p32 = flat_p if flat_p.dtype == torch.float32 else flat_p.float()
    decay_after = p32.is_cuda
    if wd > 0.0 and not decay_after:
        p32.mul_(1.0 - lr * wd)
    p32.sub_(m / (v.sqrt() + eps * sqrt_c2) * (lr * sqrt_c2 / (1.0 - row[1])))
    if wd > 0.0 and decay_after:
        p32.mul_(1.0 - lr * wd)
    if p32 is not flat_p:
        flat_p.copy_(p32)


def hooks_for(
    optimizer: torch.optim.Optimizer, *, graph: bool
) -> OptimizerInBackward | GraphedInBackward:
    """``train.optimizer_in_backward``'s hooks for ``optimizer``: graph-safe ones
    (:class:`GraphedInBackward`) when the micro-steps replay a CUDA graph, else
    :class:`poetxq.training.lowmem.OptimizerInBackward` (the optimizer's own update, eagerly).

    Raises:
        ValueError: ``graph`` with an optimizer :class:`GraphedInBackward` cannot capture.
    """
    return GraphedInBackward(optimizer) if graph else OptimizerInBackward(optimizer)
