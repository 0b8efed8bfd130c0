"""Model surgery: build a transformers Llama from a recipe and swap its projections for POET-X(Q).

The q/k/v/o and gate/up/down projections (``nn.Linear``) are replaced by
:class:`~poetxq.model.layer.POETXLinear` with a normalized-Gaussian ``W0``; embeddings, ``lm_head``
and RMSNorms stay ordinary trainable parameters. Every target layer is converted — dimensions that
are not a multiple of the block size get a masked ragged last block, and the summary says which.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from poetxq.model.blockcache import attach_block_cache
from poetxq.model.config import ModelConfig, POETConfig, check_block_size
from poetxq.model.layer import POETXLinear, POETXSwiGLUMLP
from quant_kernels.policy import KernelPolicy, default_policy


@dataclass
class ConvertedLayer:
    """One converted projection: its module path, shape and how ragged dims were handled."""

    name: str
    in_features: int
    out_features: int
    ragged_in: int | None  # size of the ragged last input block, None if b | n
    ragged_out: int | None


@dataclass
class SurgeryReport:
    """What :func:`convert_to_poetx` did."""

    layers: list[ConvertedLayer] = field(default_factory=list)
    block_size: int = 0
    bits: int = 8
    variant: str = "mem"
    quant_type: str = "nf4"
    fused_mlps: int = 0  # MLPs replaced by POETXSwiGLUMLP
    structure: str = "block"  # POET-BS or POET-FS (poetxq.model.orthogonal)
    w0_gemm: str = "auto"  # the layers' KernelPolicy.w0_gemm (the recipe's poet.gemm)

    def ragged(self) -> list[ConvertedLayer]:
        return [c for c in self.layers if c.ragged_in or c.ragged_out]


def build_llama(
    cfg: ModelConfig,
    vocab_size: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> LlamaForCausalLM:
    """A randomly initialised ``LlamaForCausalLM`` of the recipe's shape and ``vocab_size``.

    Args:
        cfg: the recipe's ``model`` section.
        vocab_size: tokenizer vocabulary.
        device: where parameters are created (default CPU); building a large model directly on
            the GPU avoids a slow CPU initialisation.
        dtype: parameter dtype (default fp32).
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=cfg.head_width,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        initializer_range=cfg.initializer_range,
        tie_word_embeddings=cfg.tie_word_embeddings,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )
    config._attn_implementation = "sdpa"
    if device is None and dtype is None:
        return LlamaForCausalLM(config)
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype or torch.float32)
        with torch.device(device or "cpu"):
            return LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)


def build_empty_llama(cfg: ModelConfig, vocab_size: int) -> LlamaForCausalLM:
    """:func:`build_llama` with every parameter on the meta device (no memory, no random init).

    Buffers are real and computed on the CPU as in :func:`build_llama` (the rotary ``inv_freq``
    is bit-identical). Tied parameters come out untied (accelerate's ``init_empty_weights``
    re-creates each parameter it registers); :func:`materialize_meta_parameters` ties them again.
    """
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return build_llama(cfg, vocab_size)


def _initializable(module: nn.Module) -> bool:
    """Whether transformers' default ``_init_weights`` initialises ``module``'s own parameters."""
    name = type(module).__name__
    return isinstance(module, (nn.Linear, nn.Embedding)) or "RMSNorm" in name or "LayerNorm" in name


def cast_floating(params: Iterable[nn.Parameter], dtype: torch.dtype) -> int:
    """Give each floating-point parameter of ``params`` the dtype ``dtype`` in place (``p.data``:
    the ``Parameter`` objects stay); returns how many were cast."""
    n = 0
    for p in params:
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            n += 1
    return n


@torch.no_grad()
def materialize_meta_parameters(
    model: nn.Module,
    device: torch.device | str,
    *,
    within: nn.Module | None = None,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Allocate every parameter of ``model`` still on the meta device on ``device`` and initialise
    it as transformers does at construction; then move the buffers to ``device`` too.

    Each module owning a meta parameter gets fresh storage and ``model._init_weights(module)``
    (embeddings and linears ``N(0, initializer_range)``, RMSNorms 1), drawn from ``device``'s
    default generator (``torch.manual_seed`` / accelerate's ``set_seed`` seed it identically on
    every rank). Tied weights (``config.tie_word_embeddings``) are tied again first and initialised
    once, from the input embedding, as at construction.

    Args:
        model: a transformers ``PreTrainedModel`` (e.g. from :func:`build_empty_llama`, possibly
            after :func:`convert_to_poetx` replaced its linears).
        device: where the parameters are created.
        within: only this submodule of ``model`` (e.g. one decoder layer, to be quantized before
            the next is allocated); weights are tied only when the whole model is materialized.
        dtype: the floating-point dtype the parameters end in (``torch.bfloat16`` for a
            ``bf16-true`` run); each module's are drawn in float32 as usual and cast right after,
            so the device never holds more than one module's float32 copy (the values equal a
            cast of the whole float32 model afterwards). None: float32.

    Returns:
        The names of the materialized parameters (relative to ``within`` if given), in module
        order.

    Raises:
        ValueError: a meta parameter belongs to a module that ``_init_weights`` does not handle.
    """
    dev = torch.device(device)
    root = model if within is None else within
    if within is None and getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()  # on the meta tensors: the tied pair is one parameter from here on
    old_params: list[nn.Parameter] = []  # keeps the meta tensors alive: ids stay unique
    pending: list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]] = []
    for mod_name, mod in root.named_modules():
        own = [(n, p) for n, p in mod._parameters.items() if p is not None and p.is_meta]
        if not own:
            continue
        if not _initializable(mod):
            raise ValueError(
                f"{mod_name} ({type(mod).__name__}) has meta parameters that transformers' "
                "_init_weights does not initialise"
            )
        pending.append((mod_name, mod, own))
    # module by module: allocate, initialise, cast; a parameter shared by several modules (tied
    # weights) is allocated and initialised once, by the first
    fresh: dict[int, nn.Parameter] = {}
    names: list[str] = []
    for mod_name, mod, own in pending:
        new: list[nn.Parameter] = []
        for n, p in own:
            if id(p) not in fresh:
                old_params.append(p)
                fresh[id(p)] = nn.Parameter(
                    torch.empty_like(p, device=dev), requires_grad=p.requires_grad
                )
                new.append(fresh[id(p)])
            mod._parameters[n] = fresh[id(p)]
            names.append(f"{mod_name}.{n}" if mod_name else n)
        if new:
            model._init_weights(mod)
            if dtype is not None:
                cast_floating(new, dtype)
    root.to(dev)  # buffers (rotary inv_freq, ...) computed on the CPU
    return names


def _ragged(dim: int, b: int) -> int | None:
    r = dim % b
    return r or None


def convert_to_poetx(
    model: nn.Module,
    cfg: POETConfig,
    *,
    generator: torch.Generator | None = None,
    keep_weights: bool = False,
    device: torch.device | str | None = None,
    kernels: KernelPolicy | None = None,
    param_dtype: torch.dtype | None = None,
) -> SurgeryReport:
    """Replace every target ``nn.Linear`` in ``model`` by a :class:`POETXLinear` in place.

    ``W0`` is drawn fresh (normalized Gaussian), as POET-X trains from scratch, and the linear
    layer's original initialisation is discarded — unless ``keep_weights``: then ``W0`` is the
    layer's own weight as it is (quantized, no re-initialisation or row normalisation) and its
    bias is copied, for continuing from a pretrained checkpoint.
    On a GPU a fresh ``W0`` is drawn on the device (one seed per layer from ``generator``, then a
    ``torch.Generator`` on the device): the same numbers on every GPU and every rank. On the CPU it
    is drawn from ``generator`` itself in float64 (:func:`~poetxq.model.layer.normalized_gaussian`).

    Args:
        model: a transformers Llama-family model. Without ``keep_weights`` its target linears may
            be on the meta device (never allocated): only their shapes are read.
        cfg: the recipe's ``poet`` section (bits, block size, variant, target modules, ...).
        generator: RNG for ``W0`` and the permutations (reproducible from the run seed).
        keep_weights: use each layer's existing weight (and bias) as ``W0``.
        device: where the POET-X(Q) layers are created and ``W0`` is drawn and quantized; default
            each linear's own device. Required when the linears are on the meta device.
        kernels: the kernel policy of every converted layer; default
            :func:`quant_kernels.policy.default_policy` (``POETXQ_KERNELS``), read once here.
            ``cfg.gemm`` other than ``auto`` replaces its ``w0_gemm``.
        param_dtype: the dtype each converted layer's parameters (``Q``, bias) are cast to right
            after the layer is built (``torch.bfloat16`` for a ``bf16-true`` run), so the whole
            model's float32 ``Q`` never exists at once; buffers (``W0``, scales, permutations)
            are left as built. None: float32.

    Returns:
        A :class:`SurgeryReport` listing the converted layers.

    Raises:
        ValueError: no target module found, the block size exceeds a layer dimension, or a target
            is on the meta device with ``keep_weights`` or without ``device``.
    """
    report = SurgeryReport(
        block_size=cfg.block_size, bits=cfg.bits, variant=cfg.variant, quant_type=cfg.quant_type,
        structure=cfg.structure,
    )  # fmt: skip
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in cfg.target_modules
    ]
    if not targets:
        raise ValueError(f"no nn.Linear named one of {cfg.target_modules} found in the model")
    b = cfg.block_size
    kernels = default_policy() if kernels is None else kernels
    if cfg.gemm != "auto":  # the recipe's poet.gemm; auto leaves the policy's own choice
        kernels = replace(kernels, w0_gemm=cfg.gemm)
    report.w0_gemm = kernels.w0_gemm
    for name, lin in targets:
        n, m = lin.in_features, lin.out_features
        check_block_size(b, (m, n), f" of {name} ({m}x{n})")
        dev = torch.device(device) if device is not None else lin.weight.device
        if dev.type == "meta" or (keep_weights and lin.weight.is_meta):
            raise ValueError(
                f"{name} is on the meta device: pass device= (and keep_weights only with real "
                "weights)"
            )
        weight = lin.weight.detach().float() if keep_weights else None
        if weight is None and dev.type != "cpu":  # draw W0 on the device (a CPU draw is slow at 8B)
            seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
            g = torch.Generator(device=dev).manual_seed(seed)
            weight = torch.randn(m, n, device=dev, generator=g, dtype=torch.float32)
            weight /= weight.norm(dim=1, keepdim=True)
        new = POETXLinear(
            n,
            m,
            weight=weight,
            dtype=lin.weight.dtype,
            block_size=b,
            bits=cfg.bits,
            variant=cfg.variant,
            neumann_terms=cfg.neumann_terms,
            structure=cfg.structure,
            bias=lin.bias is not None,
            stochastic_requant=cfg.requant == "stochastic",
            generator=generator,
            device=dev,
            quant_type=cfg.quant_type,
            double_quant=cfg.double_quant,
            kernels=kernels,
        )
        if keep_weights and lin.bias is not None:
            with torch.no_grad():
                new.bias.copy_(lin.bias)
        if cfg.freeze_orthogonal:
            for p in new.orthogonal_parameters():
                p.requires_grad_(False)
        if param_dtype is not None:
            cast_floating(new.parameters(), param_dtype)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        report.layers.append(ConvertedLayer(name, n, m, _ragged(n, b), _ragged(m, b)))
    report.fused_mlps = fuse_swiglu_mlps(model)
    old = getattr(model, "poetx_block_cache", None)
    if old is not None:
        old.remove()
    model.poetx_block_cache = attach_block_cache(model)  # one batched CNP per model forward
    return report


def fuse_swiglu_mlps(model: nn.Module) -> int:
    """Replace each SiLU-gated MLP whose three projections are POET-X(Q) layers of one variant
    by a :class:`POETXSwiGLUMLP` (same submodules and state-dict keys). ``mem``: keeps two
    ``[T, f]`` tensors for backward instead of four; ``fast``: the plain composition, or with
    the kernel policy's ``lean_fast_swiglu`` three instead of four plus the permuted input.
    Returns how many MLPs were replaced."""
    count = 0
    for name, mod in list(model.named_modules()):
        projs = [getattr(mod, a, None) for a in ("gate_proj", "up_proj", "down_proj")]
        act = getattr(mod, "act_fn", None)
        if (
            all(isinstance(p, POETXLinear) for p in projs)
            and len({p.variant for p in projs}) == 1
            and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation")
            and projs[2].bias is None
        ):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, POETXSwiGLUMLP(*projs))
            count += 1
    return count


def poet_layers(model: nn.Module) -> list[POETXLinear]:
    """All POET-X(Q) layers of ``model`` in module order."""
    return [m for m in model.modules() if isinstance(m, POETXLinear)]


def summarize(model: nn.Module, report: SurgeryReport) -> str:
    """Multi-line summary: layers converted, ragged handling, trainable params, frozen bytes."""
    layers = poet_layers(model)
    q_total = sum(side.num_trainable() for layer in layers for side in (layer.P, layer.R))
    q_trainable = (
        q_total if any(p.requires_grad for l_ in layers for p in l_.orthogonal_parameters()) else 0
    )
    q_ids = {id(p) for layer in layers for p in layer.orthogonal_parameters()}
    other = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in q_ids)
    frozen = sum(layer.frozen.nbytes() for layer in layers)
    frozen_params = sum(layer.in_features * layer.out_features for layer in layers)
    kind = {
        8: "int8 row-wise (bitsandbytes layout)"
        + (", int8 x int8 GEMMs" if report.w0_gemm == "int8" else ""),
        4: f"4-bit {report.quant_type.upper()} blockwise (bitsandbytes Params4bit layout)",
    }.get(report.bits, "unquantized (POET-X)")
    shapes: dict[tuple[str, int, int], int] = {}
    for c in report.layers:
        key = (c.name.rsplit(".", 1)[-1], c.out_features, c.in_features)
        shapes[key] = shapes.get(key, 0) + 1
    lines = [
        f"POET-X surgery: {len(report.layers)} linear layers converted "
        f"(b={report.block_size}, variant={report.variant}, W0 {kind}"
        + (", fully stochastic: one b x b block per side" if report.structure == "full" else "")
        + ")",
    ]
    for (proj, m, n), count in shapes.items():
        lines.append(f"  {count:3d} x {proj:<9s} {m}x{n}")
    rag = report.ragged()
    if rag:
        c = rag[0]
        lines.append(
            f"  {len(rag)} layers have dims not divisible by b={report.block_size}: padded with a "
            f"masked ragged last block (e.g. {c.name} {c.out_features}x{c.in_features}: "
            f"last in-block {c.ragged_in or report.block_size}, "
            f"last out-block {c.ragged_out or report.block_size})"
        )
    lines.append(
        f"  trainable: {q_trainable:,} orthogonal (Q) + {other:,} other "
        f"(embeddings, lm_head, norms) parameters"
    )
    lines.append(
        f"  frozen W0: {frozen_params:,} weights in {frozen / 2**20:.2f} MiB "
        f"({frozen / max(frozen_params, 1):.3f} bytes/weight)"
    )
    return "\n".join(lines)
