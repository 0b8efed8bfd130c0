"""A training micro-step (forward + backward) replayed from one CUDA graph.

A POET-XQ step launches many small kernels per layer: permutation gathers, block-diagonal
``bmm``s, the slab decoder, the Cayley–Neumann blocks. At Llama-1B…8B sizes the CPU that issues
them, not the GPU, bounds the step: the H200 profile of a Llama-8B step shows 0.37 s of GPU work
against 0.63 s of wall time, and with activation checkpointing 0.48 s against 1.72 s
(``evals/results/profiles/``). Capturing the forward and backward once and replaying the graph
issues all of them with one call.

What stays correct across replays: every tensor the graph reads is updated *in place* by the code
outside it — the optimizer writes the parameters in place, a merge (``merge_then_reinitialize``)
copies the re-quantized weight, the new permutations and ``Q = 0`` into the existing buffers, and
the batch is copied into the graph's static input. Gradients accumulate into the same ``.grad``
tensors on every replay (:meth:`GraphedMicroStep.zero_grad` zeroes them in place; setting them to
None would cut the graph off from the optimizer, so :meth:`GraphedMicroStep.__call__` puts them
back).

With ``train.optimizer_in_backward`` the optimizer step is captured too, inside the backward
(:mod:`poetxq.training.graph_optim`): no gradient outlives the replay, each is freed in the graph's
pool right after its parameter's update, and the host writes the step's learning rates and step
counts into a device tensor before each replay.

During the capture transformers' SDPA mask function is told to skip the plain causal mask as it
does outside a capture (:func:`poetxq.model.attention.causal_mask_skipped`): otherwise the graph
would replay attention with a materialized ``[B, 1, S, S]`` mask, 2.1× the GPU time at Llama-1B,
seq 1024.

Several processes replay one graph each and average their gradients after the replay
(``train.grad_sync: step``, :func:`grad_sync_mode`), not through DDP, whose gradient hooks would
all-reduce outside the graph. Not supported (refused by the run plan): DDP with a graph, shapes
that change between steps, and code that reads tensor values on the host during forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from poetxq.model.attention import causal_mask_skipped
from poetxq.model.flat import FlatParams
from poetxq.training.recipe import POET_METHODS

if TYPE_CHECKING:
    from poetxq.training.graph_optim import GraphedInBackward


def graph_wanted(recipe: Any, device: torch.device | str, world: int = 1) -> bool:
    """Whether a run of ``recipe`` on ``device`` with ``world`` processes replays its
    micro-steps from a CUDA graph (``train.cuda_graph``).

    ``True`` / ``False`` are returned as set (``True`` where it cannot work is refused by the
    recipe schema, or by the run plan, :func:`poetxq.training.plan.resolve_plan`, which calls
    this and whose refusals the trainer and the bench raise). ``"auto"`` is on for the
    POET methods on a CUDA device — with several processes unless ``train.grad_sync: ddp`` (the
    gradients are then all-reduced once after the replays, :func:`grad_sync_mode`; on two H200s
    that ran Llama-1B at 69,432 tokens/s against eager DDP's 22,605,
    ``evals/results/multi_gpu_step_h200x2_ab6a379.json``) — without ``gradient_checkpointing``
    and the other
    memory options (``offload_activations``, ``loss_chunk_tokens``, ``optimizer_in_backward``,
    ``offload_optimizer``):
    there the step issues thousands of small launches, and replaying them took a Llama-1B step
    from 0.32 to 0.21 s and a Llama-8B one from 0.30 to 0.27 s on an H200
    (``evals/results/throughput_1b_h200_54e0272.json`` and ``gpu_memory_8b_*_hybrid_h200.json``,
    both in git history: superseded results files are removed from the tree).
    A run that asks for activation checkpointing is saving memory first, and the graph's private
    pool held 13.5 GiB reserved at 8B with checkpointing against 11.2 GiB allocated eagerly, so
    ``auto`` leaves it eager (``true`` still takes the graph: 0.34 against 0.50–0.70 s there).
    Off everywhere else.
    """
    setting = recipe.train.cuda_graph
    if setting != "auto":
        return bool(setting)
    tc = recipe.train
    memory_options = (
        tc.gradient_checkpointing
        or tc.offload_activations
        or tc.loss_chunk_tokens
        or tc.optimizer_in_backward
        or tc.offload_optimizer
    )
    return (
        torch.device(device).type == "cuda"
        and recipe.method in POET_METHODS
        and (world == 1 or tc.grad_sync != "ddp")
        and not memory_options
    )


def graph_hint(recipe: Any, device: torch.device | str, world: int = 1) -> str | None:
    """One note for a run that ``train.cuda_graph: auto`` leaves eager although a graph would
    serve it: a POET method on one CUDA device with ``train.optimizer_in_backward`` and 8-bit
    states, which :class:`poetxq.training.graph_optim.GraphedInBackward` captures inside the
    backward. ``auto`` stays eager there because under the allocator's defaults the graph's private
    pool can hold more than the eager step (13B: 16.45 against 15.81 GiB); None otherwise."""
    tc = recipe.train
    if (
        tc.cuda_graph != "auto"
        or torch.device(device).type != "cuda"
        or world != 1
        or recipe.method not in POET_METHODS
        or not tc.optimizer_in_backward
        or recipe.optim.state_bits != 8
    ):
        return None
    return (
        "note: train.cuda_graph: true would run this step from a CUDA graph with the 8-bit "
        "optimizer inside its backward, about 1.6x faster (Llama-13B checkpointed: 0.54 s "
        "against 0.87 s eagerly; 15.80 GiB reserved with "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and train.precision: bf16-true)"
    )


def grad_sync_mode(train: Any, graph: bool, world: int) -> str:
    """How a run averages its replicas' gradients (``train.grad_sync`` resolved): ``"none"``
    in one process; ``"ddp"`` (DistributedDataParallel, all-reduce inside backward) or
    ``"step"`` (one all-reduce of every gradient after the micro-steps; what a CUDA graph
    needs). ``auto`` is ``step`` when the micro-steps replay a CUDA graph or the loss is
    chunked (``train.loss_chunk_tokens``, which calls the bare model past any DDP wrapper),
    else ``ddp``."""
    if world == 1:
        return "none"
    if train.grad_sync == "auto":
        return "step" if graph or train.loss_chunk_tokens else "ddp"
    return train.grad_sync


class CUDAGraphError(RuntimeError):
    """The forward/backward could not be captured (message names the cause and the way out)."""


class GraphedMicroStep:
    """``loss_fn(batch)`` and its ``backward()`` captured as one CUDA graph.

    Args:
        loss_fn: ``batch → scalar loss`` (already divided by the accumulation steps); runs on
            CUDA with no host synchronisation.
        example_batch: a batch of the fixed shape and dtype every later call will have (int64
            token windows ``[B, L+1]`` in the trainer); copied into the static input.
        params: the trainable parameters; their ``.grad`` tensors are created here and reused.
        flat_groups: the optimizer's flattened groups (``optimizer.flat_groups`` of
            :func:`poetxq.training.optim.adamw8bit_class`): their parameters' gradients are created
            as views of one buffer per group (:meth:`poetxq.model.flat.FlatParams.attach_grads`), so
            the 8-bit update takes one launch per group.
        warmup: eager forward/backward passes on a side stream before the capture (Triton
            compilation, cuBLAS workspaces, allocator); their gradients are zeroed afterwards.
        in_backward: ``train.optimizer_in_backward``'s graph-safe hooks
            (:class:`poetxq.training.graph_optim.GraphedInBackward`): the optimizer step is captured
            inside the backward, there are no static gradients (each is freed in the graph's
            pool after its update), and every call writes the step's learning rates first.
            The warm-up passes only rehearse the updates (parameters unchanged).

    Attributes:
        allocated_before_capture, reserved_before_capture: ``torch.cuda.memory_allocated`` /
            ``memory_reserved`` (bytes) just before the capture, after the warm-up's cached
            blocks were handed back.
        pool_reserved_bytes: what the capture added to the reserved bytes (the graph's private
            pool, which holds every activation of a replay).

    Raises:
        CUDAGraphError: not a CUDA batch, the capture failed (the cause is in the message), or
            ``in_backward`` captured no update.
    """

    def __init__(
        self,
        loss_fn: Callable[[torch.Tensor], torch.Tensor],
        example_batch: torch.Tensor,
        params: list[torch.nn.Parameter],
        *,
        warmup: int = 2,
        flat_groups: Sequence[FlatParams] = (),
        in_backward: GraphedInBackward | None = None,
    ) -> None:
        if not example_batch.is_cuda:
            raise CUDAGraphError("CUDA graphs need a CUDA device; set train.cuda_graph: false")
        self.params = [p for p in params if p.requires_grad]
        self.in_backward = in_backward
        self.static_batch = example_batch.clone()
        if in_backward is not None:
            in_backward.prepare()  # the state tensors the captured updates will write
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        rehearsal = in_backward.rehearsal() if in_backward else contextlib.nullcontext()
        with torch.cuda.stream(side), rehearsal:
            for _ in range(max(warmup, 1)):
                loss_fn(self.static_batch).backward()
        torch.cuda.current_stream().wait_stream(side)
        for p in self.params:  # the warm-up's gradients are zeroed below anyway: dropped before
            p.grad = None  # the flat buffers exist, so the two never coexist
        self.grads: list[torch.Tensor] = []
        if in_backward is None:  # static gradients, accumulated into during every replay
            for group in flat_groups:  # laid out like the optimizer's flat buffers
                group.attach_grads()
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.grads = [p.grad for p in self.params]
        self.zero_grad()
        # the warm-up's freed activations stay cached in the default pool, which the capture's
        # private pool cannot use: hand them back to the driver before the pool grows (the
        # steady-state reserved peak on the H200 stayed the same, the pool's own fragmentation
        # dominates: evals/results/gpu_memory_graph_h200_90a76c3.json)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        dev = self.static_batch.device
        # what the capture adds to the reserved bytes (its private pool, bytes), beside what
        # was allocated and reserved outside it just before (evals/gpu_memory.py records them)
        self.allocated_before_capture = torch.cuda.memory_allocated(dev)
        self.reserved_before_capture = torch.cuda.memory_reserved(dev)
        self.graph = torch.cuda.CUDAGraph()
        try:  # whole windows, no cache: attention stays is_causal=True (poetxq.model.attention)
            with causal_mask_skipped(), torch.cuda.graph(self.graph):
                self.static_loss = loss_fn(self.static_batch)
                self.static_loss.backward()
        except Exception as exc:  # the capture's own errors are long; keep the first line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CUDAGraphError(
                f"CUDA graph capture failed ({first}); set train.cuda_graph: false"
            ) from exc
        torch.cuda.synchronize()
        self.pool_reserved_bytes = torch.cuda.memory_reserved(dev) - self.reserved_before_capture
        if in_backward is not None and in_backward.reset_count() == 0:
            raise CUDAGraphError(
                "the captured backward updated no parameter (train.optimizer_in_backward); "
                "set train.cuda_graph: false"
            )
        self.zero_grad()

    def zero_grad(self) -> None:
        """Zero the gradients in place (the graph keeps writing to these tensors); nothing to
        do with ``in_backward`` (no gradient outlives the replay)."""
        if self.grads:
            torch._foreach_zero_(self.grads)

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        """Replay on ``batch`` (same shape/dtype as the example): gradients are *added* to
        ``.grad``; returns the graph's loss tensor (overwritten by the next replay)."""
        if batch.shape != self.static_batch.shape or batch.dtype != self.static_batch.dtype:
            raise CUDAGraphError(
                f"batch {tuple(batch.shape)} {batch.dtype} differs from the captured "
                f"{tuple(self.static_batch.shape)} {self.static_batch.dtype}; "
                "CUDA graphs need a fixed batch shape"
            )
        self.static_batch.copy_(batch, non_blocking=True)
        if self.in_backward is not None:
            self.in_backward.before_replay()
        self.graph.replay()
        if self.in_backward is not None:
            self.in_backward.after_replay()
        if self.grads:  # static gradients: keep them attached (None would cut the graph off)
            for p, g in zip(self.params, self.grads, strict=True):
                if p.grad is not g:
                    p.grad = g
        return self.static_loss


def capture_micro_step(
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    batch: torch.Tensor,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    train: Any,
    say: Callable[[str], None],
    in_backward: GraphedInBackward | None = None,
) -> GraphedMicroStep | None:
    """Capture the first micro-batch's forward+backward for the trainer and ``poetxq bench``.

    Args:
        loss_fn, batch: as :class:`GraphedMicroStep`'s ``loss_fn`` and ``example_batch``.
        model: its trainable parameters are the graph's (``.grad`` created and reused).
        optimizer: its ``flat_groups`` (if any) lay out the gradients.
        train: the recipe's ``train`` section; ``train.cuda_graph`` decides what a failure does.
        say: where the one line about the graph (or its failure) goes.
        in_backward: the optimizer step to capture inside the backward
            (``train.optimizer_in_backward``; :class:`GraphedMicroStep`).

    Returns:
        The :class:`GraphedMicroStep`, or ``None`` when the capture failed under
        ``train.cuda_graph: auto``: the failure is one note and the caller runs eagerly (the
        warm-up passes' gradients are dropped).

    Raises:
        CUDAGraphError: the capture failed and ``train.cuda_graph`` is ``true``.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    try:
        graphed = GraphedMicroStep(
            loss_fn, batch, trainable, flat_groups=getattr(optimizer, "flat_groups", ()),
            in_backward=in_backward,
        )  # fmt: skip
    except CUDAGraphError as exc:
        if train.cuda_graph is True:
            raise
        for p in trainable:  # what the warm-up passes accumulated
            p.grad = None
        say(f"note: {exc}; with train.cuda_graph auto the run continues eagerly")
        return None
    say(
        "cuda graph: each micro-batch's forward+backward"
        + (" and the optimizer step in it" if in_backward is not None else "")
        + " replays one CUDA graph (train.cuda_graph; set it to false to run eagerly)"
    )
    return graphed
