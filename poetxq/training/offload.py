"""Gradients and optimizer states in host memory, with exact clipping and accumulation
(``train.offload_optimizer``, the ``lowest`` memory plan of :mod:`poetxq.training.memory`).

The persistent GPU memory of a low-bit POET model at batch 1 is mostly the frozen ``W0``; after it
come the trainable parameters, their optimizer states and their gradients (at Llama-8B with 8-bit
states: 1.16 GiB of parameters, 1.18 GiB of states and 1.16 GiB of bf16 gradients, beside 7.26 GiB
of int8 ``W0``). :class:`HostOffload` keeps the states and the gradients in (pinned) host memory
and brings each parameter's share to the GPU only while that parameter is updated:

* **during backward** a post-accumulate-grad hook copies each parameter's gradient to its host
  buffer as soon as it is complete and frees it. From the second micro-batch of a step on, the
  buffer is first brought back and the new gradient added to it on the GPU (the same in-place
  ``+=`` in the gradient's dtype that autograd's own accumulation into ``.grad`` does, so the
  accumulated gradient is bit-identical). On the step's last micro-batch the hook also adds the
  accumulated gradient's norm to the step's list of norms (on the GPU, no synchronization).
* **after backward**, :meth:`HostOffload.step` forms the global norm from those per-tensor norms
  exactly as ``torch.nn.utils.clip_grad_norm_`` does (2-norm of the 2-norms, each in its
  gradient's dtype; coefficient
  ``max_norm / (norm + 1e-6)`` clamped at 1), then updates one parameter at a time: its gradient
  and optimizer states come to the GPU, the gradient is scaled by the coefficient, the
  optimizer's own update runs (:func:`poetxq.training.optim.update_one`), and the states go back
  to their host buffers.

So gradient clipping (global norm, the post-merge re-warm included) and gradient accumulation
keep their exact meaning, unlike :class:`poetxq.training.lowmem.OptimizerInBackward`, which
updates before the global norm exists. The cost is host↔device traffic: per micro-batch one copy
of every gradient to the host (and, from the second micro-batch, one back), per step one copy of
every gradient and state to the GPU and of every state back. All copies are queued on the
current stream, in order with the kernels that read and write the same buffers; :meth:`step`
ends with one device synchronization, so the host buffers are complete whenever the CPU reads
them (``optimizer.state_dict()`` for a checkpoint).

Needs an optimizer whose states are tensors of their own per parameter (the run builds its 8-bit
optimizer without flattened groups here) and one process (the gradients are not all-reduced).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from poetxq.training.optim import update_one


class HostOffload:
    """Keep ``optimizer``'s gradients and states in host memory (module docstring).

    Use as: set :attr:`final` before each micro-batch's backward (``True`` on the step's last),
    run the backwards, then call :meth:`step` once instead of clipping and ``optimizer.step()``.

    Args:
        optimizer: the run's optimizer (torch ``AdamW``, or bitsandbytes ``AdamW8bit`` with one
            state tensor set per parameter; its state may already exist, e.g. after a resume:
            it moves to the host here).
        params: the parameters to handle (default: every parameter of ``optimizer`` that
            requires a gradient).
        host: where the buffers live (default: the CPU, pinned when CUDA is there).

    Raises:
        ValueError: a parameter is in none of ``optimizer``'s param groups, or the optimizer's
            groups are flattened (``flatten_group`` of the class
            :func:`poetxq.training.optim.adamw8bit_class` returns), whose states are views of
            one buffer per group and cannot move per parameter.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Iterable[nn.Parameter] | None = None,
        host: torch.device | str = "cpu",
    ) -> None:
        if getattr(optimizer, "flat_groups", None):
            raise ValueError(
                "HostOffload needs one optimizer state per parameter; build the optimizer "
                "without flattened groups (build_optimizer(..., flatten=False))"
            )
        self.optimizer = optimizer
        self.host = torch.device(host)
        self._pin = self.host.type == "cpu" and torch.cuda.is_available()
        self._where: dict[int, tuple[int, int]] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                self._where[id(p)] = (gi, pi)
        chosen = (
            [p for g in optimizer.param_groups for p in g["params"]] if params is None else params
        )
        self.params = [p for p in chosen if p.requires_grad]
        for p in self.params:
            if id(p) not in self._where:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is not in the optimizer's param "
                    "groups; build HostOffload from the optimizer that trains it"
                )
        #: host buffer of each parameter's gradient (accumulated over the step's micro-batches)
        self.grads: dict[int, torch.Tensor] = {}
        self._fresh: set[int] = set()  # gradients not yet written this step
        self._norms: list[torch.Tensor] = []  # per-tensor 2-norms of the final gradients
        #: set before each backward: whether it is the step's last micro-batch
        self.final = True
        #: host buffers of each parameter's optimizer states, by state name
        self._host_states: dict[int, dict[str, torch.Tensor]] = {}
        opt: Any = optimizer
        if getattr(opt, "initialized", None) is False and hasattr(opt, "check_overrides"):
            # bitsandbytes moves every parameter's state to its device on its first update
            # (``to_gpu``); done here instead, that move never happens: each state comes to the
            # device only for its own parameter's update (a resumed run's would all come at once)
            opt.check_overrides()
            opt.initialized = True
        self._handles = [p.register_post_accumulate_grad_hook(self._take) for p in self.params]
        self._fresh.update(id(p) for p in self.params)
        for p in self.params:
            self._states_to_host(p)

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device=self.host, pin_memory=self._pin)

    @torch.no_grad()
    def _take(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ``p.grad`` (this micro-batch's) joins its host buffer."""
        g = p.grad
        key = id(p)
        buf = self.grads.get(key)
        if buf is None or buf.shape != g.shape or buf.dtype != g.dtype:
            buf = self.grads[key] = self._buffer(g)
        if key in self._fresh:
            self._fresh.discard(key)
            acc = g
        else:
            acc = buf.to(g.device, non_blocking=True)
            acc += g
        if self.final:
            self._norms.append(torch.linalg.vector_norm(acc, 2.0))
        buf.copy_(acc, non_blocking=True)
        p.grad = None

    @torch.no_grad()
    def step(self, max_norm: float = math.inf) -> torch.Tensor:
        """Clip the step's accumulated gradients by their global 2-norm and update every
        parameter that received one (module docstring).

        Args:
            max_norm: the clipping threshold (``inf``: no clipping; the norm is still computed).

        Returns:
            the global gradient norm before clipping, a 0-d fp32 tensor on the parameters' device
            (``nan`` when no gradient arrived).

        Raises:
            RuntimeError: some parameters got a gradient this step and others did not, or the
                step's last backward did not run with :attr:`final` set.
        """
        got = [p for p in self.params if id(p) not in self._fresh]
        device = self.params[0].device if self.params else torch.device("cpu")
        if not got:
            return torch.tensor(float("nan"), device=device)
        if len(self._norms) != len(got):
            raise RuntimeError(
                f"HostOffload.step: {len(got)} parameters have gradients but {len(self._norms)} "
                "were final; set .final = True before the step's last backward"
            )
        total = torch.linalg.vector_norm(torch.stack(self._norms), 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0) if math.isfinite(max_norm) else None
        for p in got:
            gi, pi = self._where[id(p)]
            grad = self.grads[id(p)].to(p.device, non_blocking=True)
            if coef is not None:
                grad.mul_(coef)  # as clip_grad_norm_: the fp32 coefficient
            p.grad = grad
            self._states_to_device(p)
            update_one(self.optimizer, gi, pi, p)
            p.grad = None
            self._states_to_host(p)
        self._fresh.update(id(p) for p in self.params)
        self._norms.clear()
        if device.type == "cuda":  # the host buffers are complete when the CPU reads them
            torch.cuda.synchronize(device)
        return total

    def _states_to_device(self, p: torch.Tensor) -> None:
        state = self.optimizer.state.get(p)
        for k, t in (state or {}).items():
            if torch.is_tensor(t) and t.device != p.device and t.device == self.host:
                state[k] = t.to(p.device, non_blocking=True)

    def _states_to_host(self, p: torch.Tensor) -> None:
        """Move ``p``'s state tensors to host buffers (reused from step to step: a state's
        buffer is the tensor the optimizer's state holds between steps)."""
        state = self.optimizer.state.get(p)
        if not state:
            return
        kept = self._host_states.setdefault(id(p), {})
        for k, t in state.items():
            if not torch.is_tensor(t) or t.device == self.host:
                continue
            buf = kept.get(k)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = kept[k] = self._buffer(t)
            buf.copy_(t, non_blocking=True)
            state[k] = buf

    def offload_states(self) -> None:
        """Move every state tensor to the host again (after ``optimizer.load_state_dict``,
        which puts the states on the parameters' devices)."""
        for p in self.params:
            self._states_to_host(p)
        if any(p.is_cuda for p in self.params):
            torch.cuda.synchronize()

    def remove(self) -> None:
        """Detach the hooks (later backwards leave gradients in ``.grad`` again)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
