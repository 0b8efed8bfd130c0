"""Many small parameters behind one contiguous buffer, so one kernel launch can serve them all.

A POET-X(Q) model trains hundreds of packed ``Q`` tensors (560 in a Llama-13B at b = 256).
bitsandbytes' 8-bit AdamW launches one update kernel per tensor, and the batched Cayley–Neumann
evaluation (:mod:`poetxq.model.blockcache`) concatenates every ``Q`` before its one CNP call; on the
H200 those per-tensor launches and that copy were ~50 ms of a 0.5 s Llama-13B step
(``evals/results/profiles/``). :class:`FlatParams` re-homes a list of parameters as views into one
buffer, in order, each starting at a multiple of ``align`` elements (256: bitsandbytes' block of
8-bit optimizer state, so a flat update quantizes exactly the blocks a per-tensor one would).
Then:

* the optimizer updates each run of gradients laid out like the buffer with one launch
  (:meth:`FlatParams.grad_runs`, :func:`poetxq.training.optim.adamw8bit_class`);
* :func:`adjacent_span` sees that neighbouring parameters already lie end to end in memory and
  returns one view over them, where a ``torch.cat`` would copy (:mod:`poetxq.model.blockcache`).

Nothing here changes a value: the parameters keep their shapes, names and ``state_dict``; only
their storage moves. Code that later replaces a parameter's ``.data`` (``module.to(device)``
after flattening, for example) just breaks the sharing: :meth:`FlatParams.intact` then says so and
callers fall back to the per-tensor path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

#: elements per block of bitsandbytes' blockwise 8-bit optimizer state (one absmax each)
BNB_STATE_BLOCK = 256


def adjacent_span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D view over ``tensors`` when they lie end to end in one storage, else None.

    Args:
        tensors: contiguous tensors of one dtype and device, in memory order (``tensors[i+1]``
            starts where ``tensors[i]`` ends).

    Returns:
        A 1-D view ``[sum numel]`` of their common storage (writing to it writes to them), or
        None when any tensor is non-contiguous, of another dtype/device/storage, or not directly
        after the previous one.
    """
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    es = first.element_size()
    end = first.data_ptr()
    total = 0
    for t in tensors:
        if (
            t.dtype != first.dtype
            or t.device != first.device
            or not t.is_contiguous()
            or t.data_ptr() != end
            or t.untyped_storage().data_ptr() != storage
        ):
            return None
        end += t.numel() * es
        total += t.numel()
    return first.detach().as_strided((total,), (1,), first.storage_offset())


class FlatParams:
    """Parameters re-homed, in order, as views into one zero-padded 1-D buffer.

    Args:
        params: distinct parameters of one dtype and device (any shapes).
        align: each parameter starts at a multiple of this many elements; the gaps hold zeros
            (256 = bitsandbytes' 8-bit optimizer-state block).
        stage_on_host: copy the parameters to host memory and let their device storage go
            before the buffer is allocated, so the device never holds them twice (a build's
            peak memory would otherwise pass the training step's by their size); values and
            layout are the same either way. Default: on CUDA.

    Attributes:
        flat: the buffer ``[numel]``, ``numel`` a multiple of ``align``.
        offsets: element offset of each parameter in ``flat``.

    Raises:
        ValueError: empty list, repeated parameter, or mixed dtypes/devices.
        torch.OutOfMemoryError: no room for the buffer; staged parameters then hold their
            values in host memory (moved off their device), unstaged ones are untouched.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        align: int = BNB_STATE_BLOCK,
        *,
        stage_on_host: bool | None = None,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError("FlatParams needs at least one parameter")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("FlatParams got the same parameter twice")
        if len({(p.dtype, p.device) for p in params}) != 1:
            raise ValueError("FlatParams needs parameters of one dtype and device")
        self.params = params
        self.align = align
        self.offsets: list[int] = []
        end = 0
        for p in params:
            start = -(-end // align) * align
            self.offsets.append(start)
            end = start + p.numel()
        self.numel = -(-end // align) * align
        p0 = params[0]
        shapes = [p.shape for p in params]
        sources = [p.detach().reshape(-1) for p in params]
        staged = p0.device.type == "cuda" if stage_on_host is None else stage_on_host
        if staged:
            sources = [t.to("cpu", copy=True) for t in sources]
            for p in params:  # the device storage goes now (unless held elsewhere)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            if p0.device.type == "cuda":  # hand the freed blocks back: the reserved peak too
                torch.cuda.empty_cache()
        try:
            self.flat = torch.zeros(self.numel, dtype=p0.dtype, device=p0.device)
        except torch.OutOfMemoryError:
            if staged:  # the values live on in the host copies: the parameters point there
                for p, shape, src in zip(params, shapes, sources, strict=True):
                    p.data = src.view(shape)
            raise
        with torch.no_grad():
            for p, o, shape, src in zip(params, self.offsets, shapes, sources, strict=True):
                slot = self.flat[o : o + src.numel()]
                slot.copy_(src)
                p.data = slot.view(shape)

    def slot(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s slice of a buffer laid out like :attr:`flat`, shaped like it."""
        p, o = self.params[i], self.offsets[i]
        return buffer[o : o + p.numel()].view(p.shape)

    def intact(self) -> bool:
        """Whether every parameter still lives in :attr:`flat` (nobody replaced its ``.data``)."""
        base, es = self.flat.data_ptr(), self.flat.element_size()
        return all(
            p.data_ptr() == base + o * es and p.device == self.flat.device
            for p, o in zip(self.params, self.offsets, strict=True)
        )

    def attach_grads(self) -> torch.Tensor:
        """Give every parameter a zero ``.grad`` that is a view into one new buffer laid out like
        :attr:`flat` (returned), so that gradients accumulated into them in place (autograd does
        so once ``.grad`` exists; :class:`poetxq.training.cudagraph.GraphedMicroStep` keeps them)
        form a single :meth:`grad_runs` run, gaps included (they stay zero)."""
        buf = torch.zeros_like(self.flat)
        for i, p in enumerate(self.params):
            p.grad = self.slot(buf, i)
        self._attached = buf.untyped_storage().data_ptr()
        return buf

    _attached: int = 0  # storage of the last attach_grads buffer (its gaps are known zeros)

    def _follows(self, i: int, grads: list[torch.Tensor]) -> bool:
        """Whether gradient ``i`` lies where the layout of :attr:`flat` puts it after ``i-1``."""
        prev, cur = grads[i - 1], grads[i]
        step = self.offsets[i] - self.offsets[i - 1]
        storage = cur.untyped_storage().data_ptr()
        return (
            cur.dtype == prev.dtype
            and cur.device == prev.device
            and cur.is_contiguous()
            and prev.is_contiguous()
            and storage == prev.untyped_storage().data_ptr()
            and cur.data_ptr() == prev.data_ptr() + step * cur.element_size()
            # a gap is only known to hold zeros in a buffer of attach_grads
            and (step == prev.numel() or storage == self._attached)
        )

    def grad_runs(self) -> list[tuple[int, int, torch.Tensor]] | None:
        """The gradients as maximal runs laid out in memory as their parameters are in
        :attr:`flat`.

        Returns:
            ``[(start, end, grad)]``: the gradients of parameters ``start..end-1`` (indices into
            :attr:`params`) lie in one storage at the same relative positions as the parameters
            in :attr:`flat`, ``grad`` being a 1-D view over them (no copy) from the first one's
            start to the last one's end. The batched CNP's backward leaves every ``Q`` gradient
            of a forward end to end in one run (one per checkpointed layer under activation
            checkpointing), :meth:`attach_grads` puts all of them in one; unrelated gradients
            give one run per parameter. None when a parameter has no gradient.
        """
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):
            return None
        runs = []
        start = 0
        for i in range(1, len(grads) + 1):
            if i < len(grads) and self._follows(i, grads):  # type: ignore[arg-type]
                continue
            first = grads[start].detach()  # type: ignore[union-attr]
            if i - start == 1:  # one tensor: itself (copied only if not contiguous)
                span = first.reshape(-1)
            else:  # contiguous tensors at flat's relative positions (_follows)
                n = self.offsets[i - 1] + grads[i - 1].numel() - self.offsets[start]  # type: ignore[union-attr]
                span = first.as_strided((n,), (1,), first.storage_offset())
            runs.append((start, i, span))
            start = i
        return runs
