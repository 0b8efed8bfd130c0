"""Launch a plain ``@triton.jit`` kernel with less host time: compiled kernels cached by call.

``kernel[grid](*args, **meta)`` runs Triton's binder on every call: each argument is
specialized (dtype, 16-byte alignment, integer divisibility), a cache key is built and looked
up, then the compiled kernel's launcher runs. On the H200's host that is ~20–25 µs per launch,
against ~8 µs for the launcher alone, and an eager POET-XQ step issues thousands of them (a
Llama-8B step with activation checkpointing: ~2,800; ``evals/results/profiles/
host_profile_8b_ckpt_oib_h200_f06c09c.txt``), so an eager step is bound by its host.

:func:`launch` keeps the :class:`~triton.compiler.CompiledKernel` that the first call of a kind
returned, keyed by everything Triton specializes on — each tensor's dtype and whether its
address is a multiple of 16, each integer's exact value, each constexpr and launch option's
value, the current device — and launches later calls of the same key through the compiled
kernel's own launcher (``CompiledKernel[grid](*args)``), skipping the binder. A call the cache
has not seen, a kernel that is not a plain ``JITFunction``, the Triton interpreter, or
``POETXQ_TRITON_DIRECT_LAUNCH=0`` take Triton's own path. Keying on exact integer values is
stricter than Triton's own key (which only asks whether an integer is 1 or a multiple of 16),
so a hit never runs a kernel compiled for other specializations; a training step repeats the
same shapes, so its calls hit after the first step.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton

__all__ = ["DIRECT_LAUNCH", "launch"]

#: launch through the cache of compiled kernels (``POETXQ_TRITON_DIRECT_LAUNCH=0``: never)
DIRECT_LAUNCH = os.environ.get("POETXQ_TRITON_DIRECT_LAUNCH", "1") != "0"

_CACHE: dict[tuple, tuple[Any, tuple[str, ...]]] = {}
_MAX_ENTRIES = 8192  # distinct calls kept; the cache is cleared (not trimmed) beyond that


def _arg_key(a: object) -> object:
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return ("i", a)
    if isinstance(a, float):
        return float  # Triton passes Python floats as fp32 and does not specialize on them
    return ("v", a)  # a dtype or other hashable constant


def _direct_ok(kernel: object) -> bool:
    return (
        DIRECT_LAUNCH
        and isinstance(kernel, triton.runtime.jit.JITFunction)
        and os.environ.get("TRITON_INTERPRET") != "1"
    )


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)``, through the cache of compiled kernels where it can.

    Args:
        kernel: a ``@triton.jit`` function (anything else is launched as ``kernel[grid]``).
        grid: 1 to 3 program counts (a tuple, not a callable).
        *args: the kernel's leading arguments, positionally.
        **meta: the remaining arguments by name (constexprs) and launch options
            (``num_warps``, ``num_stages``); every argument of the kernel must be given.

    Raises:
        whatever ``kernel[grid](*args, **meta)`` raises on a first call (compile errors, bad
        arguments); a cached call raises nothing new.
    """
    if not _direct_ok(kernel):
        kernel[grid](*args, **meta)
        return
    key = (
        kernel,
        torch.cuda.current_device() if torch.cuda.is_available() else -1,
        tuple(_arg_key(a) for a in args),
        tuple((k, _arg_key(v)) for k, v in meta.items()),
    )
    hit = _CACHE.get(key)
    if hit is not None:
        compiled, names = hit
        values = [*args, *(meta[n] for n in names)]
        g = (*grid, 1, 1)
        compiled[g[:3]](*values)
        return
    compiled = kernel[grid](*args, **meta)
    compiled = compiled.result() if hasattr(compiled, "result") else compiled
    arg_names = list(kernel.arg_names)
    rest = tuple(arg_names[len(args) :])
    if not all(n in meta for n in rest) or not hasattr(compiled, "__getitem__"):
        return  # defaults or an unknown return: keep Triton's path for this call kind
    if len(_CACHE) >= _MAX_ENTRIES:
        _CACHE.clear()
    _CACHE[key] = (compiled, rest)
