"""Multi-process (DDP) helpers of the training loop: data order, gradient sync, replica checks.

The loop runs unchanged under ``accelerate launch`` / ``torchrun`` with N processes:

* **Data.** :class:`ShardedBatches` gives every rank its own slice of one *global* batch. Epoch
  ``e`` visits the training windows in the order ``randperm(N)`` drawn from a generator seeded
  with ``(seed, e)``; global batch ``k`` is the ``k``-th run of ``B·W`` indices of that order and
  rank ``r`` takes its ``r``-th run of ``B`` (``B`` = per-rank batch, ``W`` = world size). No
  window is seen twice in an epoch, ranks never overlap, and the order is a pure function of the
  position, so a resumed run continues with exactly the next batch (nothing to save but a count).
  With ``W = 1`` and ``B' = W·B`` the same rows form the same global batches: one process with
  batch ``W·B`` and ``W`` processes with batch ``B`` train on identical data.
* **Gradients.** DDP all-reduces (averages) the ``.grad`` of trainable parameters. The int8
  weights of Q-GaLore / Q-APOLLO keep their gradient in ``QuantLinear.float_grad`` (an integer
  parameter cannot hold one), which DDP does not see: :func:`all_reduce_float_grads` averages them
  once per optimizer step, after the last micro-batch.
* **Merges.** POET merges are deterministic functions of replicated state and a generator seeded
  identically on every rank, so each rank computes the same new ``W0`` and permutations without
  any communication (a rank-0 merge + broadcast would move the whole frozen weight every merge).
  :func:`replica_fingerprint` lets the loop check that ranks still agree after a merge.
* **Stopping.** :class:`StopSignals` turns SIGTERM/SIGINT into a flag that the loop reads at the
  end of a step; :func:`any_rank` agrees on it across ranks so every rank stops at the same step.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from types import FrameType

import torch
import torch.distributed as dist
from torch import nn

from poetxq.data.config import DataError

#: elements per all-reduce bucket of float gradients (fp32: 100 MiB)
BUCKET_ELEMENTS = 25 * 2**20


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class ShardedBatches:
    """Position-addressable, rank-sharded, shuffled batches of packed windows (module docstring).

    Args:
        windows: int64 ``[N, L+1]`` training windows (kept where they are; batches are views
            gathered with ``index_select``).
        batch_size: windows per rank per micro-batch ``B``.
        rank: this process's rank ``r`` (0-based).
        world_size: number of processes ``W``.
        seed: seed of the epoch permutations.

    Raises:
        DataError: ``N < B·W`` (not one full global batch; a ``ValueError``); ValueError: a bad
            rank.
    """

    def __init__(
        self, windows: torch.Tensor, batch_size: int, *, rank: int, world_size: int, seed: int
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.windows = windows
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.global_batch = batch_size * world_size
        self.batches_per_epoch = windows.shape[0] // self.global_batch
        if self.batches_per_epoch == 0:
            raise DataError(
                f"training split has {windows.shape[0]} windows, fewer than one global batch "
                f"(train.batch_size {batch_size} x {world_size} processes); lower "
                "train.batch_size or train.seq_len"
            )
        self._epoch: int | None = None
        self._perm = torch.empty(0, dtype=torch.long)

    def __len__(self) -> int:
        """Global batches per epoch (the last partial one is dropped)."""
        return self.batches_per_epoch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The visiting order of epoch ``epoch``: int64 ``[N]``, a permutation of ``range(N)``."""
        if self._epoch != epoch:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (1 << 62))
            self._perm = torch.randperm(self.windows.shape[0], generator=gen)
            self._epoch = epoch
        return self._perm

    def indices(self, position: int) -> torch.Tensor:
        """Window indices (int64 ``[B]``) of this rank's micro-batch number ``position`` (0-based,
        counting every micro-batch drawn since the start of training)."""
        epoch, k = divmod(position, self.batches_per_epoch)
        start = k * self.global_batch + self.rank * self.batch_size
        return self.epoch_order(epoch)[start : start + self.batch_size]

    def batch(self, position: int) -> torch.Tensor:
        """This rank's micro-batch number ``position``: int64 ``[B, L+1]``."""
        return self.windows.index_select(0, self.indices(position).to(self.windows.device))

    def iterate(self, start: int = 0) -> Iterator[torch.Tensor]:
        """Micro-batches ``start, start+1, ...`` forever (epochs roll over)."""
        position = start
        while True:
            yield self.batch(position)
            position += 1


@torch.no_grad()
def all_reduce_float_grads(grads: list[torch.Tensor]) -> None:
    """Average ``grads`` (fp32 tensors, any shapes) across ranks in place, in buckets.

    One flat all-reduce (sum, then divide by the world size) per ``BUCKET_ELEMENTS`` elements, the
    same averaging DDP applies to parameter gradients. No-op without an initialized process group
    of more than one rank.
    """
    if not _initialized() or not grads:
        return
    world = dist.get_world_size()
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat.div_(world)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    for g in grads:
        bucket.append(g)
        size += g.numel()
        if size >= BUCKET_ELEMENTS:
            flush()
            bucket, size = [], 0
    if bucket:
        flush()


@torch.no_grad()
def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers into every other rank's ``module`` in place,
    one tensor at a time. DDP syncs the parameters when it wraps a model;
    :mod:`poetxq.training.train` calls this instead when ``train.grad_sync`` is ``step`` (no DDP
    wrapper), and sends the buffers too (the frozen ``W0`` codes: about 13 GB at Llama-13B, once at
    start). Bool tensors travel as ``uint8``. No-op without an initialized process group of more
    than one rank."""
    if not _initialized():
        return
    for t in [*module.parameters(), *module.buffers()]:
        data = t.data.view(torch.uint8) if t.dtype == torch.bool else t.data
        dist.broadcast(data, src)


@torch.no_grad()
def replica_fingerprint(module: nn.Module) -> torch.Tensor:
    """A float64 ``[3·T]`` fingerprint of ``module``'s state dict (``T`` tensors).

    Per tensor: the sum, the sum of squares and a position-weighted sum (weights ``i mod 1009``) of
    its values as float64. Ranks whose fingerprints agree hold the same weights, permutations and
    quantization state (up to a collision that a single differing element cannot cause).
    """
    out = []
    for t in module.state_dict().values():
        x = t.detach().reshape(-1).to(torch.float64)
        w = (torch.arange(x.numel(), device=x.device) % 1009).to(torch.float64)
        out += [x.sum(), (x * x).sum(), (x * w).sum()]
    if not out:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack(out)


def replicas_identical(module: nn.Module) -> bool:
    """True when every rank's :func:`replica_fingerprint` of ``module`` equals rank 0's (always
    True in a single process). Collective: every rank must call it."""
    if not _initialized():
        return True
    fp = replica_fingerprint(module)
    ref = fp.clone()
    dist.broadcast(ref, src=0)
    same = torch.tensor(float(torch.equal(fp, ref)), device=fp.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item())


def any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """``flag`` OR-ed over all ranks (collective; ``flag`` itself in a single process)."""
    if not _initialized():
        return flag
    t = torch.tensor(float(flag), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class StopSignals:
    """Context manager: SIGTERM / SIGINT set :attr:`received` instead of killing the process.

    The training loop polls :attr:`received` at the end of each step, saves a checkpoint and
    returns. A second SIGINT restores the default behaviour (raises ``KeyboardInterrupt``), except
    within ``grace_s`` seconds of the first: a double tap of Ctrl-C still stops cleanly. With
    ``announce`` the first signal prints one line saying so. Outside the main thread (where
    handlers cannot be installed) it does nothing.
    """

    def __init__(
        self,
        signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
        *,
        grace_s: float = 1.0,
        announce: bool = False,
    ) -> None:
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None
        self.grace_s, self.announce = grace_s, announce
        self._first_at = 0.0
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            if sig == signal.SIGINT and time.monotonic() - self._first_at >= self.grace_s:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt
            return  # a repeat within the grace period, or another SIGTERM: already stopping
        self.received, self._first_at = sig, time.monotonic()
        if self.announce:
            print(
                f"\npoetxq: {sig.name}: stopping after this step (checkpoint and summary); "
                + (
                    "Ctrl-C again to abort at once"
                    if sig == signal.SIGINT
                    else "Ctrl-C to abort at once"
                ),
                file=sys.stderr,
                flush=True,
            )

    def guard(self, steps: Iterable[int]) -> Iterator[int]:
        """Yield ``steps`` with the handlers installed; they are removed when the loop ends
        (exhausted, ``break`` or an exception)."""
        with self:
            yield from steps

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
