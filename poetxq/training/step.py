"""One optimizer step's mechanics, shared by the trainer, ``poetxq bench`` and the GPU benchmarks.

A step is ``train.grad_accum`` micro-batches, each a forward+backward run eagerly or replayed
from the CUDA graph captured on the first one (``train.cuda_graph``), then the update, in one of
four ways the recipe chooses:

- ``train.offload_optimizer``: gradients and states wait in host memory; :class:`HostOffload`
  clips by the exact global norm and applies every update;
- ``train.optimizer_in_backward``: each parameter was updated (and its gradient freed) inside
  backward; there is no norm to report;
- int8 baseline weights (Q-GaLore, Q-APOLLO): the global norm spans ``.grad`` and the quantized
  weights' ``float_grad`` (:func:`poetxq.baselines.clip_grad_norm_all`);
- otherwise the clip of ``torch`` (or the launcher's, e.g. accelerate's) and ``optimizer.step()``.

The loop around it (data, schedule, merges, logging, checkpoints) stays with each caller.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from poetxq.baselines import clip_grad_norm_all, quant_modules
from poetxq.training.cudagraph import GraphedMicroStep, capture_micro_step
from poetxq.training.graph_optim import GraphedInBackward, hooks_for
from poetxq.training.offload import HostOffload

ClipFn = Callable[[Iterable[torch.Tensor], float], torch.Tensor]


class StepEngine:
    """Micro-batch forward+backward (eager or CUDA graph) and the clipped update of one step.

    Args:
        model: what forward runs through (possibly wrapped, e.g. by DDP); its parameters are
            clipped and, for a graph, laid out as the graph's gradients.
        optimizer: the unwrapped optimizer: its hooks (``train.optimizer_in_backward``), host
            offload and ``flat_groups`` (the graph's gradient layout) come from it.
        train: the recipe's ``train`` section (``grad_accum``, ``optimizer_in_backward``,
            ``offload_optimizer``, ``cuda_graph``).
        loss_fn: ``loss_fn(batch) -> loss``, the micro-batch's mean next-token loss (a 0-dim
            float tensor), *not* divided by ``grad_accum``; ``batch`` is int64 ``[B, S + 1]``.
        graph: capture the micro-step in a CUDA graph (:func:`poetxq.training.cudagraph.
            graph_wanted`); a failed capture under ``train.cuda_graph: auto`` runs eagerly.
        echo: where the one line about the graph (or its failure) goes.
        backward: ``backward(loss)`` for an eager micro-batch, given the undivided loss
            (default: ``(loss / grad_accum).backward()``; accelerate's ``backward`` divides by
            its ``gradient_accumulation_steps`` itself).
        clip: ``clip(parameters, max_norm) -> total norm`` (default
            ``torch.nn.utils.clip_grad_norm_``); not used for int8 baseline weights or offload.
        stepper: what ``.step()`` and ``.zero_grad()`` are called on (default ``optimizer``; the
            trainer passes accelerate's wrapper).
        offload: start host offload now (default: when ``train.offload_optimizer``); a caller
            that loads a checkpoint first passes ``False`` and calls :meth:`start_offload` after.

    Raises:
        ValueError: ``train.optimizer_in_backward`` with an optimizer :func:`hooks_for` cannot
            hook (from there).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train: Any,
        *,
        loss_fn: Callable[[torch.Tensor], torch.Tensor],
        graph: bool,
        echo: Callable[[str], None] = print,
        backward: Callable[[torch.Tensor], None] | None = None,
        clip: ClipFn | None = None,
        stepper: Any = None,
        offload: bool | None = None,
    ) -> None:
        self.model, self.optimizer, self.train = model, optimizer, train
        self.loss_fn, self.graph, self.echo = loss_fn, graph, echo
        self._backward = backward or (lambda loss: (loss / train.grad_accum).backward())
        self._clip = clip or torch.nn.utils.clip_grad_norm_
        self.stepper = optimizer if stepper is None else stepper
        self.qmods = quant_modules(model)  # int8 baseline weights: gradients in float_grad
        self.in_backward = (
            hooks_for(optimizer, graph=graph) if train.optimizer_in_backward else None
        )  # fmt: skip
        self.offload: HostOffload | None = None
        if train.offload_optimizer if offload is None else offload:
            self.start_offload()
        self.graphed: GraphedMicroStep | None = None

    def start_offload(self) -> None:
        """Move gradients and optimizer states to host memory from now on (``HostOffload``)."""
        self.offload = HostOffload(self.optimizer)

    def _micro_loss(self, batch: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(batch) / self.train.grad_accum

    def micro(self, batch: torch.Tensor, *, final: bool) -> torch.Tensor:
        """Forward+backward of one micro-batch; its gradients add to ``.grad``.

        Args:
            batch: int64 token ids ``[B, S + 1]`` on the model's device.
            final: the step's last micro-batch (host offload reads the norm from its gradients).

        Returns:
            The micro-batch's loss (0-dim, undivided; not detached on the eager path).

        Raises:
            poetxq.training.cudagraph.CUDAGraphError: the capture failed under
                ``train.cuda_graph: true``.
        """
        if self.offload is not None:
            self.offload.final = final
        if self.graph and self.graphed is None:  # captured on the first micro-batch
            hooks = self.in_backward if isinstance(self.in_backward, GraphedInBackward) else None
            self.graphed = capture_micro_step(
                self._micro_loss, batch, self.model, self.optimizer, self.train, self.echo, hooks
            )
            self.graph = self.graphed is not None
        if self.graphed is not None:
            return self.graphed(batch) * self.train.grad_accum
        loss = self.loss_fn(batch)
        self._backward(loss)
        return loss

    def clip(self, max_norm: float | None) -> torch.Tensor | float:
        """Clip the step's gradients to ``max_norm`` (``None``/0: no clipping) and apply the
        offloaded update; returns the global gradient norm before clipping (NaN when the
        optimizer ran in backward)."""
        limit = max_norm or math.inf
        if self.offload is not None:  # the exact global norm, clipping and every update
            return self.offload.step(limit)
        if self.in_backward is not None:  # updated and freed during backward: no norm
            return math.nan
        if self.qmods:
            return clip_grad_norm_all(self.model.parameters(), self.qmods, limit)
        return self._clip(self.model.parameters(), limit)

    def update(self, max_norm: float | None) -> torch.Tensor | float:
        """Clip, step the optimizer and zero the gradients; returns the norm of :meth:`clip`.

        With the optimizer in backward or host offload every gradient was already applied and
        freed: ``step()`` finds none and does nothing (a scheduler still sees it called).

        Raises:
            RuntimeError: ``train.optimizer_in_backward`` and no hook fired during an eager
                backward (no parameter was trained).
        """
        norm = self.clip(max_norm)
        # (a replayed graph runs no hook: its capture checked that it holds the updates)
        hooks, graphed = self.in_backward, self.graphed
        if hooks is not None and graphed is None and hooks.reset_count() == 0:
            raise RuntimeError(
                "train.optimizer_in_backward updated no parameter in backward; "
                "set train.optimizer_in_backward: false"
            )
        self.stepper.step()
        self.zero_grad()
        return norm

    def zero_grad(self) -> None:
        """Zero the gradients: in place for a graph (it keeps writing to them), else ``None``."""
        if self.graphed is not None:
            self.graphed.zero_grad()
        else:
            self.stepper.zero_grad(set_to_none=True)

    def recapture(self) -> None:
        """Capture the graph again at the next micro-batch (the model's structure changed)."""
        self.graphed = None

    def remove(self) -> None:
        """Remove the in-backward hooks and host offload (they hold the optimizer)."""
        if self.in_backward is not None:
            self.in_backward.remove()
        if self.offload is not None:
            self.offload.remove()
