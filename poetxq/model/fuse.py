"""The elementwise chains of a Llama layer, fused by ``torch.compile`` (on by default on CUDA).

transformers' ``LlamaRMSNorm`` runs as eight separate kernels forward (cast to fp32, square,
mean, add, rsqrt, multiply, cast back, scale) and more backward, and its rotary embedding
(``apply_rotary_pos_emb``) as about ten (two ``cat`` among them), each one a full pass over a
``[tokens, hidden]`` activation; the SwiGLU product of the fused POET ``mem`` MLP takes two
kernels forward and five backward over ``[tokens, intermediate]``. In an H200 profile of a
Llama-13B POET-XQ step those passes were about a fifth of the GPU time
(``evals/results/profiles/``). :func:`fuse_elementwise` hands them to ``torch.compile``
(Inductor), which emits one fused kernel per chain; the math is the same (Inductor keeps the
intermediates of a chain in fp32, so bf16 results can differ in the last bit from eager's
per-op rounding).

:func:`fuse_wanted` decides from the recipe (``train.fuse_elementwise``). Only these pieces are
compiled, never the POET-X(Q) layers (their Triton kernels and custom autograd functions stay as
they are). The first forward compiles (tens of seconds); later calls reuse the compiled code for
every layer.

Shapes: the first call compiles for its exact shapes (static kernels, as a run of one shape
wants); a call whose batch, sequence or width differs recompiles once with that size symbolic
(``torch.compile``'s automatic dynamic shapes), so a process that runs many shapes (an
evaluation batch, ``evals/throughput.py`` over models and sequence lengths) keeps the fused code
instead of piling up one static compile per shape until dynamo's ``recompile_limit`` (8) sends
every later shape to eager. Fusing another model starts dynamo afresh (``torch._dynamo.reset``),
so each model's first shapes compile static again, as in a run of that model alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from poetxq.model import swiglu
from poetxq.model.layer import POETXSwiGLUMLP


def fuse_wanted(train: Any, device: torch.device | str, graph: bool | None = None) -> bool:
    """Whether ``train.fuse_elementwise`` (a recipe's ``train`` section) asks for
    :func:`fuse_elementwise` on ``device``; ``graph``: whether the run replays a CUDA graph
    (:func:`poetxq.training.cudagraph.graph_wanted`; default: ``train.cuda_graph is True``).

    ``True``/``False`` are obeyed on CUDA; ``"auto"`` is on, except with
    ``gradient_checkpointing`` outside a CUDA graph: there each compiled call runs twice (forward
    and recomputation) with its host-side guard and autograd wrapper, and a Llama-13B step on an
    H200 became slower (0.89 s against 0.69 s) although its GPU time fell 14 %
    (``evals/results/fuse_elementwise_h200.json``). Never on a CPU (Inductor would need a C++
    compiler there and the eager kernels are not launch-bound).
    """
    if torch.device(device).type != "cuda":
        return False
    if graph is None:
        graph = train.cuda_graph is True
    if train.fuse_elementwise == "auto":
        return not (train.gradient_checkpointing and not graph)
    return bool(train.fuse_elementwise)


def _set_swiglu_maps(model: nn.Module, maps: swiglu.SwiGLUMaps) -> bool:
    """Give every fused POET MLP of ``model`` the SwiGLU ``maps``; whether one changed."""
    changed = False
    for module in model.modules():
        if isinstance(module, POETXSwiGLUMLP) and module.maps is not maps:
            module.maps = maps
            changed = True
    return changed


def _is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "weight")


def fuse_elementwise(model: nn.Module, *, backend: str = "inductor") -> int:
    """Compile every RMSNorm module of ``model`` in place (``nn.Module.compile``: names and
    ``state_dict`` unchanged), transformers' Llama ``apply_rotary_pos_emb``, and give ``model``'s
    fused POET MLPs the compiled SwiGLU maps (:func:`poetxq.model.swiglu.compiled_maps`).

    Args:
        model: a transformers Llama (or any model with ``*RMSNorm`` modules).
        backend: the ``torch.compile`` backend (``"inductor"`` for fused kernels; tests use
            ``"aot_eager"``, which needs no compiler).

    Returns:
        The number of modules and functions compiled now (0 when all already were): the
        RMSNorm modules, the rotary function, and the two SwiGLU maps when an MLP of ``model``
        took them now.

    Notes:
        The rotary function (in ``transformers.models.llama.modeling_llama``) is replaced for
        the whole process (every model there uses the compiled one; same results); the SwiGLU
        maps only for ``model``. A model not fused before resets dynamo's compiled code of the whole
        process (``torch._dynamo.reset``; module docstring: shapes): other compiled functions
        compile again at their next call.
    """
    norms = [
        m for m in model.modules()
        if _is_rms_norm(m) and getattr(m, "_compiled_call_impl", None) is None
    ]  # fmt: skip
    if norms:  # a new model: its first shapes compile static, not as sizes seen before
        torch._dynamo.reset()
    for module in norms:
        # dynamic=None: static first, a changed size recompiles once with that size symbolic
        module.compile(backend=backend, dynamic=None)
    done = len(norms)
    compiled = swiglu.compiled_maps(backend)
    if _set_swiglu_maps(model, compiled):
        done += 2  # the forward and the gradient map
    try:
        from transformers.models.llama import modeling_llama
    except ImportError:  # pragma: no cover - transformers without Llama
        return done
    rope = modeling_llama.apply_rotary_pos_emb
    if not rope_fused():
        # the pair is kept here, not as attributes of the compiled object: recent transformers
        # wrap the function in a module (hub-kernel dispatch), and torch.compile's wrapper of a
        # module forwards attribute writes to it, so they would stick to the plain function
        _ROPE["compiled"] = torch.compile(rope, backend=backend, dynamic=None)
        _ROPE["original"] = rope
        modeling_llama.apply_rotary_pos_emb = _ROPE["compiled"]
        done += 1
    return done


#: the compiled rotary function :func:`fuse_elementwise` installed and the one it replaced
_ROPE: dict[str, Any] = {"compiled": None, "original": None}


def rope_fused() -> bool:
    """Whether transformers' Llama ``apply_rotary_pos_emb`` is the compiled one
    :func:`fuse_elementwise` installed (False without transformers' Llama)."""
    try:
        from transformers.models.llama import modeling_llama
    except ImportError:  # pragma: no cover - transformers without Llama
        return False
    fn = modeling_llama.apply_rotary_pos_emb
    return _ROPE["compiled"] is not None and fn is _ROPE["compiled"]


def unfuse_elementwise(model: nn.Module) -> int:
    """Undo :func:`fuse_elementwise`: ``model``'s RMSNorm modules and SwiGLU maps run eagerly
    again, and the process-wide rotary function is the plain one again (for every model).

    For measurements that compare settings on one built model (``evals/gpu_memory.py``, where
    ``train.fuse_elementwise=auto`` decides per setting). Returns the number of modules and
    functions restored (0 when nothing was compiled).
    """
    done = 0
    for module in model.modules():
        if _is_rms_norm(module) and getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
            done += 1
    if _set_swiglu_maps(model, swiglu.PLAIN):
        done += 2
    try:
        from transformers.models.llama import modeling_llama
    except ImportError:  # pragma: no cover - transformers without Llama
        return done
    if rope_fused():
        modeling_llama.apply_rotary_pos_emb = _ROPE["original"]
        done += 1
    return done
