"""The model a run trains, built on the run's device: recipe → Llama → POET surgery / baseline.

:func:`build_for_training` is what ``poetxq train`` and ``poetxq bench`` both call. Two ways:

* **classic** (CPU runs, and runs from a ``--model`` checkpoint): transformers builds the Llama
  in fp32 on the CPU with its random init of every weight, or loads the checkpoint there
  (:func:`poetxq.training.build.build_model`); then :func:`~poetxq.model.surgery.convert_to_poetx`
  draws ``W0`` (or keeps the checkpoint's weights), or
  :func:`~poetxq.training.baseline_methods.prepare_baseline` prepares the dense linears. On the
  CPU these are exactly the calls CPU runs always made: same RNG streams, same numbers. On CUDA
  each layer's ``W0`` is quantized on the device and the rest of the model moved there (a
  checkpoint is not loaded onto the GPU in fp32: a 24 GB GPU could not hold an 8B model that way).
* **meta init** (CUDA runs from scratch): the Llama is built with its parameters on the meta
  device (:func:`~poetxq.model.surgery.build_empty_llama`: no memory, no init; buffers such as the
  rotary ``inv_freq`` real, computed on the CPU as in the classic way). POET methods replace the
  meta linears by POET-X(Q) layers whose ``W0`` is drawn and quantized on the device, so no dense
  copy of a decoder linear is ever allocated; then the remaining parameters (embeddings, norms,
  ``lm_head``; tied when ``tie_word_embeddings``) are allocated on the device and initialised by
  transformers' own ``_init_weights`` (:func:`~poetxq.model.surgery.materialize_meta_parameters`).
  Baselines (dense linears are trained) materialize every parameter on the device the same way,
  one decoder layer at a time, each prepared (int8 for qgalore/qapollo) before the next is
  allocated. The CPU never holds a weight matrix.

Every rank of a DDP run builds its own model. The meta way draws identically on every rank: ``W0``
and the permutations come from ``generator`` (seeded from ``train.seed`` on every rank, ``W0`` via
per-layer seeds and a ``torch.Generator`` on the device), and the embeddings/norms from the
device's default generator, seeded identically on every rank by accelerate's ``set_seed``
(``torch.manual_seed`` in the bench). DDP also broadcasts rank 0's parameters (not the frozen
``W0`` buffers) when it wraps the model.

``meta_init=True`` (or ``POETXQ_META_INIT=1``) forces the meta way on the CPU (tests); its ``W0``
and permutations are then the classic way's (the CPU draw from ``generator``); the embeddings,
``lm_head`` (and a baseline's linears) have the same distribution but other draws.
``POETXQ_META_INIT=0`` turns it off on CUDA.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from poetxq.model.fuse import fuse_elementwise, fuse_wanted
from poetxq.model.pretrained import (
    PretrainedError,
    check_seq_len,
    load_pretrained,
    resolve_pretrained,
)
from poetxq.model.surgery import (
    SurgeryReport,
    build_empty_llama,
    build_llama,
    convert_to_poetx,
    materialize_meta_parameters,
    summarize,
)
from poetxq.training.baseline_methods import BaselineReport, prepare_baseline, summarize_baseline
from poetxq.training.cudagraph import graph_wanted
from poetxq.training.precision import cast_parameters, run_precision
from poetxq.training.recipe import POET_METHODS, Recipe
from quant_kernels.policy import KernelPolicy

if TYPE_CHECKING:
    from poetxq.training.plan import RunPlan

#: environment switch of :func:`use_meta_init`: ``0`` never, ``1`` always (CPU too), unset: CUDA
META_INIT_ENV = "POETXQ_META_INIT"


@dataclass
class BuiltModel:
    """What :func:`build_for_training` built, and how."""

    model: nn.Module
    device: torch.device
    keep_weights: bool  # --model: the pretrained linears are W0
    meta_init: bool  # parameters created on the meta device, then materialized on ``device``
    seconds: float  # wall time of building, surgery/preparation and moving to ``device``
    surgery: SurgeryReport | None = None  # POET methods
    baseline: BaselineReport | None = None  # baselines

    def summary(self, recipe: Recipe) -> str:
        """The multi-line surgery (POET) or baseline summary the trainer prints."""
        if self.surgery is not None:
            return summarize(self.model, self.surgery)
        assert self.baseline is not None
        return summarize_baseline(self.model, self.baseline, recipe.baseline)

    def build_line(self) -> str:
        """``model: built in 3.2 s on cuda:0 (meta init: ...)`` — one line."""
        how = (
            " (meta init: no CPU weights, W0 drawn and quantized on the device)"
            if self.meta_init
            else ""
        )
        return f"model: built in {self.seconds:.1f} s on {self.device}{how}"


def build_model(
    recipe: Recipe,
    vocab_size: int,
    *,
    echo: Callable[[str], None] = print,
    progress: bool = True,
) -> tuple[nn.Module, bool]:
    """The model a run starts from, and whether its linear weights are to be kept as ``W0``.

    Without ``model.pretrained`` this is :func:`poetxq.model.surgery.build_llama` (random init, W0
    drawn afresh at surgery). With it, the pretrained checkpoint (:func:`load_pretrained`).

    Args:
        recipe: the run's recipe.
        vocab_size: token ids the data uses (ids ``< vocab_size``).
        echo: where notes go.
        progress: False loads the checkpoint without transformers' progress bars.

    Returns:
        ``(model, keep_weights)``.

    Raises:
        PretrainedError: the checkpoint is unusable, its vocabulary is smaller than the tokenizer's
            ids, or ``train.seq_len`` exceeds its ``max_position_embeddings``.
    """
    ref = recipe.model.pretrained
    if ref is None:
        return build_llama(recipe.model, vocab_size), False
    path = resolve_pretrained(ref)
    model = load_pretrained(path, progress=progress)
    cfg: Any = model.config
    n_vocab = model.get_input_embeddings().weight.shape[0]
    if vocab_size > n_vocab:
        raise PretrainedError(
            f"the tokenizer's ids reach {vocab_size - 1} but '{ref}' embeds only {n_vocab} tokens; "
            "its tokenizer and weights do not belong together"
        )
    check_seq_len(cfg, recipe.train.seq_len, ref)
    n_params = sum(p.numel() for p in model.parameters())
    echo(
        f"model: {cfg.model_type} from {ref} ({cfg.num_hidden_layers} layers, d={cfg.hidden_size}, "
        f"{n_params:,} parameters); recipe model section ignored, weights kept as W0"
    )
    return model, True


def use_meta_init(recipe: Recipe, device: torch.device) -> bool:
    """The default of :func:`build_for_training`: meta init for a model built from scratch on CUDA
    (a ``--model`` checkpoint is loaded with its weights; CPU runs stay classic).

    ``POETXQ_META_INIT=0`` turns meta init off (CUDA runs then build on the CPU first, as before),
    ``POETXQ_META_INIT=1`` turns it on for every device (the CPU too).

    Raises:
        ValueError: ``POETXQ_META_INIT`` is set to something other than ``0`` or ``1``.
    """
    env = os.environ.get(META_INIT_ENV, "").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"{META_INIT_ENV} must be 0 or 1, got {env!r}")
    if recipe.model.pretrained is not None or env == "0":
        return False
    return env == "1" or device.type == "cuda"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prepare_baseline_layerwise(
    model: nn.Module, recipe: Recipe, device: torch.device
) -> BaselineReport:
    """Materialize and prepare (:func:`~poetxq.training.baseline_methods.prepare_baseline`) one
    decoder layer of a meta-built Llama at a time, so a quantized baseline (qgalore, qapollo)
    never holds the dense fp32 decoder on the device: only the layer being quantized.

    Returns:
        The report :func:`~poetxq.training.baseline_methods.prepare_baseline` gives for the whole
        model.
    """
    targets: list[str] = []
    group_size = None
    for i, layer in enumerate(model.model.layers):
        materialize_meta_parameters(model, device, within=layer)
        report = prepare_baseline(layer, recipe.method, recipe.baseline)
        targets += [f"model.layers.{i}.{name}" for name in report.targets]
        group_size = report.weight_group_size
    return BaselineReport(recipe.method, targets, group_size)


def build_for_training(
    recipe: Recipe,
    vocab_size: int,
    device: torch.device | str,
    *,
    generator: torch.Generator,
    echo: Callable[[str], None] = print,
    meta_init: bool | None = None,
    cuda_graph: bool | None = None,
    kernels: KernelPolicy | None = None,
    progress: bool = True,
    plan: RunPlan | None = None,
) -> BuiltModel:
    """The recipe's model on ``device``, converted (POET methods) or prepared (baselines).

    Args:
        recipe: validated recipe (``model``, ``method``, ``poet``, ``baseline`` sections).
        vocab_size: token ids the data uses.
        device: the run's device; the returned model lives there entirely.
        generator: RNG of ``W0`` and the permutations (the trainer keeps using it for merges).
        echo: where notes go (the ``--model`` line).
        meta_init: build on the meta device and materialize on ``device`` (module docstring);
            default :func:`use_meta_init`. Not available with ``model.pretrained``.
        cuda_graph: whether the run replays a CUDA graph (it decides ``fuse_elementwise:
            auto``); default :func:`poetxq.training.cudagraph.graph_wanted` for one process.
        kernels: the kernel policy of the POET-X(Q) layers; default
            :func:`quant_kernels.policy.default_policy` (``POETXQ_KERNELS``).
        progress: False loads a ``--model`` checkpoint without transformers' progress bars.
        plan: the run plan (:func:`poetxq.training.plan.resolve_plan`): where given, its
            ``meta_init``, ``cuda_graph``, ``fuse``, ``precision`` and ``kernels`` decide (the
            trainer's and the bench's way); ``meta_init``, ``cuda_graph`` and ``kernels`` given
            as well win over it.

    Returns:
        :class:`BuiltModel` (the optimizer is built by the caller).

    Raises:
        ValueError: ``meta_init`` with a pretrained model, or what surgery/preparation raise.
        poetxq.model.pretrained.PretrainedError: the ``--model`` checkpoint is unusable.
    """
    dev = torch.device(device)
    fuse = None
    precision = None
    if plan is not None:
        meta_init = plan.meta_init if meta_init is None else meta_init
        kernels = plan.kernels if kernels is None else kernels
        if cuda_graph is None:
            cuda_graph, fuse = plan.cuda_graph, plan.fuse
        precision = plan.precision
    if meta_init is None:
        meta_init = use_meta_init(recipe, dev)
    if meta_init and recipe.model.pretrained is not None:
        raise ValueError("meta init builds a model from scratch; --model loads its weights")
    is_poet = recipe.method in POET_METHODS
    precision = run_precision(recipe.train, dev) if precision is None else precision
    bf16_true = precision == "bf16-true"
    start = time.perf_counter()
    surgery = baseline = None
    if meta_init:
        keep_weights = False
        model: nn.Module = build_empty_llama(recipe.model, vocab_size)
        # bf16-true: each layer's parameters cast as they are made, so the build never holds
        # the float32 model beside the int8 W0 (its peak would pass the training step's)
        pdtype = torch.bfloat16 if bf16_true else None
        if is_poet:  # the meta linears are replaced before anything is allocated
            surgery = convert_to_poetx(
                model, recipe.poet, generator=generator, device=dev, kernels=kernels,
                param_dtype=pdtype,
            )  # fmt: skip
        else:  # decoder layer by layer: at most one layer's dense fp32 weights beside the rest
            baseline = _prepare_baseline_layerwise(model, recipe, dev)
        materialize_meta_parameters(model, dev, dtype=pdtype)
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"meta init left tensors on the meta device: {left[:5]}")
    else:  # classic: built (or loaded) on the CPU; there, exactly the calls CPU runs always made
        model, keep_weights = build_model(recipe, vocab_size, echo=echo, progress=progress)
        on_gpu = dev.type == "cuda"  # a --model checkpoint, or meta init turned off
        if is_poet:  # on a GPU each layer's W0 is moved there and quantized there
            surgery = convert_to_poetx(
                model, recipe.poet, generator=generator, keep_weights=keep_weights,
                device=dev if on_gpu else None, kernels=kernels,
            )  # fmt: skip
        else:
            if on_gpu:  # int8 baselines quantize on the GPU
                model.to(dev)
            baseline = prepare_baseline(model, recipe.method, recipe.baseline)
        model.to(dev)
    if bf16_true:  # bf16 parameters, no autocast (the meta way: the baselines' layers)
        cast_parameters(model, torch.bfloat16)
    if cuda_graph is None:
        cuda_graph = graph_wanted(recipe, dev)
    if fuse is None:
        fuse = fuse_wanted(recipe.train, dev, cuda_graph)
    if fuse:  # torch.compile of RMSNorm, rotary, SwiGLU
        fuse_elementwise(model)
    _sync(dev)
    return BuiltModel(
        model=model, device=dev, keep_weights=keep_weights, meta_init=meta_init,
        seconds=time.perf_counter() - start, surgery=surgery, baseline=baseline,
    )  # fmt: skip
