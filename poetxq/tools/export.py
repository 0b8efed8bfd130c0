"""The way out: POET-X(Q) runs as Hugging Face / bitsandbytes checkpoints.

A run directory holds the frozen weight in *permuted* coordinates (``Ψ_m W0 Ψ_nᵀ`` for int8 and
16-bit; ``Ψ_m W0``, rows only, for 4-bit) and the orthogonal factors ``R``, ``P`` separately.
Everything outside poetxq wants one weight ``W`` per layer in the model's own coordinates, so
export does, per POET-X(Q) layer, on the model loaded into memory (the run directory is only read):

* **the layer's own format** (an int8 store → ``hf-bnb8``; a 4-bit store → ``hf-bnb4`` with the
  run's code, when ``in_features`` is a multiple of 64): first **merge** it exactly as training
  does (:meth:`POETXLinear.merge_then_reinitialize`: fold ``R``, ``P`` into ``W0`` in fp32 and
  re-quantize with the run's rounding policy; afterwards ``R = P = I``), then write the **stored
  codes themselves** with rows (int8: and columns) permuted back: int8 ``CB``/``SCB`` as stored;
  4-bit packed nibbles and block scales moved whole row by whole row. Only the 4-bit double-quant
  statistics are recomputed (bitsandbytes' ``quantize_blockwise`` of the reordered scales, whose
  groups of 256 change). So the export *is* the run's model after one more training merge, up to
  bf16 and that re-done double quant (0.5–0.7 % relative logits on the test model). Between merges
  ``R·W0·P`` is not on the 4-bit grid: the merge itself, one 4-bit rounding, changes the logits by
  ~10–12 % there (int8: ~0.7 %), exactly as the run's next merge would.
* **any other case** (``hf-bf16``; a format or code other than the store's; 4-bit rows that are
  not whole 64-blocks): ``W = layer.effective_weight()`` (``R · W0 · P`` folded in fp32, permuted
  back) is rounded once into the format; the layer is not merged.

Formats:

* ``hf-bf16``: a plain transformers checkpoint, every tensor bf16;
* ``hf-bnb8``: int8 row-wise, bitsandbytes ``Linear8bitLt`` state-dict keys ``weight`` (int8 CB
  ``[m, n]``), ``SCB`` (fp32 ``[m]``), ``weight_format`` (uint8 0);
* ``hf-bnb4``: NF4/FP4 (blocksize 64, double quant), bitsandbytes ``Linear4bit`` keys ``weight``
  (uint8 ``[m·n/2, 1]``), ``weight.absmax``, ``weight.quant_map``, ``weight.nested_absmax``,
  ``weight.nested_quant_map``, ``weight.quant_state.bitsandbytes__<type>``;

with ``quantization_config`` (``quant_method: bitsandbytes``, transformers' ``BitsAndBytesConfig``
serialization) in ``config.json`` for the bnb formats, so that
``AutoModelForCausalLM.from_pretrained(out_dir)`` rebuilds ``Linear8bitLt`` / ``Linear4bit``
layers from the stored bytes. Embeddings, norms and ``lm_head`` are written in bf16.

bitsandbytes 0.50.2 facts this module relies on (checked in ``tests/test_export.py``):

* ``Linear8bitLt(..., has_fp16_weights=False)`` loads ``weight``/``SCB``/``weight_format`` with
  ``load_state_dict`` once the module has been moved to its device (``.to("cpu")`` / ``.cuda()``).
* ``Linear4bit.load_state_dict`` does not read the quant-state keys (they come back as unexpected
  keys); the supported way in is ``Params4bit.from_prequantized(weight, stats, module=layer)``,
  which is what transformers calls.
* Its CPU ``dequantize_4bit`` returns wrong values when a 64-block straddles two rows and the row
  length is a multiple of 16 (e.g. ``in_features`` 96 or 160); ``in_features % 64 == 0`` is safe.
  Export warns about such layers; the bytes it writes are right either way.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import quant_kernels
from poetxq.model.layer import POETXLinear
from poetxq.model.quant import INT8_ROW_FORMAT, Blockwise4bitWeight, Int8RowwiseWeight
from poetxq.training.recipe import POET_METHODS, Recipe, RecipeError, load_recipe
from quant_kernels import reference_4bit as q4

FORMATS: tuple[str, ...] = ("hf-bf16", "hf-bnb8", "hf-bnb4")
TOKENIZER_DIR = "tokenizer"  # inside a run directory
CONFIG_FILE = "config.json"  # the transformers model config, inside a run directory


class ExportError(ValueError):
    """A run cannot be exported as asked; the message is one line naming the fix."""


# --------------------------------------------------------------------------------------------
# One layer: the merged weight under bitsandbytes' keys
# --------------------------------------------------------------------------------------------


def bnb_int8_state_dict(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` ``[m, n]`` (float) as a bitsandbytes ``Linear8bitLt`` state dict.

    Returns:
        ``{"weight": int8 [m, n] (CB), "SCB": fp32 [m] (row absmax), "weight_format": uint8 0}``,
        round-to-nearest (bit-identical to ``bitsandbytes.functional.int8_vectorwise_quant`` on
        fp16 input).

    Raises:
        ValueError: ``weight`` is not a 2-D float tensor.
    """
    cb, scb = quant_kernels.quantize_int8_rowwise(weight)
    return {
        "weight": cb.contiguous(),
        "SCB": scb.contiguous(),
        "weight_format": torch.tensor(INT8_ROW_FORMAT, dtype=torch.uint8),
    }


def bnb_4bit_state_dict(
    weight: torch.Tensor,
    quant_type: str = "nf4",
    *,
    blocksize: int = 64,
    double_quant: bool = True,
) -> dict[str, torch.Tensor]:
    """``weight`` ``[m, n]`` (float) as a bitsandbytes ``Linear4bit`` state dict.

    Keys: ``weight`` (uint8 ``[ceil(m·n/2), 1]``), ``weight.absmax``, ``weight.quant_map``,
    [``weight.nested_absmax``, ``weight.nested_quant_map``] and
    ``weight.quant_state.bitsandbytes__<quant_type>``; round-to-nearest, byte-identical to
    ``bitsandbytes.functional.quantize_4bit``. The quant_state's ``dtype`` is ``weight.dtype``.

    Raises:
        ValueError: unknown ``quant_type``, bad ``blocksize`` or non-2-D ``weight``.
    """
    store = Blockwise4bitWeight(
        weight, quant_type=quant_type, blocksize=blocksize, double_quant=double_quant
    )
    return {k: v.contiguous() for k, v in store.state_dict().items()}


EXPORT_MERGE_SEED = 0  # seeds the permutations (and stochastic rounding) of export's merges


def writes_stored_codes(layer: POETXLinear, fmt: str, quant_type: str = "nf4") -> bool:
    """Whether ``fmt`` can hold ``layer``'s own stored codes unchanged (after a merge).

    True for an int8 store exported as ``hf-bnb8`` (row-wise scales survive permutations) and for
    a 4-bit store of ``quant_type`` with blocksize 64 exported as ``hf-bnb4`` when
    ``in_features`` is a multiple of 64 (every stored row is whole 64-blocks and whole bytes, so
    un-permuting rows moves blocks and their scales unchanged). Otherwise export rounds the
    effective weight into ``fmt`` afresh.
    """
    frozen = layer.frozen
    if fmt == "hf-bnb8":
        return isinstance(frozen, Int8RowwiseWeight)
    if fmt == "hf-bnb4":
        return (
            isinstance(frozen, Blockwise4bitWeight)
            and frozen.quant_type == quant_type
            and frozen.blocksize == 64
            and layer.in_features % 64 == 0
        )
    return False


def is_merged(layer: POETXLinear) -> bool:
    """``R = P = I`` exactly (``Q = 0`` on both sides): nothing left to fold into ``W0``."""
    return not (bool(layer.P.Q.detach().any()) or bool(layer.R.Q.detach().any()))


def _double_quantize_bnb(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any, float]:
    """bitsandbytes' double quantization of fp32 block scales ``[nb]`` (as ``quantize_4bit``
    with ``compress_statistics=True`` does it): ``offset = mean``, ``absmax - offset`` quantized
    8-bit blockwise (block 256, dynamic map) by ``bitsandbytes.functional.quantize_blockwise``.

    Returns:
        ``(uint8 absmax [nb], nested_absmax fp32 [ceil(nb/256)], nested_quant_map fp32 [256],
        offset)``.
    """
    import bitsandbytes.functional as bnbF

    absmax = absmax.float().contiguous()
    offset = absmax.mean()
    q, nested = bnbF.quantize_blockwise(absmax - offset, blocksize=256)
    return q, nested.absmax.float(), nested.code.float(), float(offset.item())


def stored_codes_state_dict(layer: POETXLinear, fmt: str) -> dict[str, torch.Tensor]:
    """A merged layer's stored codes, permuted back to original coordinates, under ``fmt``'s keys.

    No weight is rounded: ``hf-bnb8`` gets the stored int8 ``CB`` ``[m, n]`` and ``SCB`` ``[m]``
    with rows (and, for the int8 store's ``Ψ_m W0 Ψ_nᵀ``, columns) un-permuted; ``hf-bnb4`` gets
    the stored packed nibbles of ``Ψ_m W0`` with whole rows un-permuted (uint8
    ``[m·n/2, 1]``) and the block scales moved with their blocks. Only the double-quant statistics
    are recomputed (bitsandbytes' ``quantize_blockwise`` of the reordered fp32 scales, groups of
    256 in the new flat order), which moves each scale by at most one 8-bit step of its group.

    Args:
        layer: a POET-X(Q) layer with ``R = P = I`` (:func:`is_merged`) whose store ``fmt`` holds
            (:func:`writes_stored_codes`).
        fmt: ``"hf-bnb8"`` or ``"hf-bnb4"``.

    Returns:
        Keys relative to the layer, as :func:`bnb_int8_state_dict` / :func:`bnb_4bit_state_dict`
        (the 4-bit quant_state's ``dtype`` is the store's).

    Raises:
        ValueError: the layer is not merged, or ``fmt`` cannot hold its codes.
    """
    frozen = layer.frozen
    fits = writes_stored_codes(layer, fmt, getattr(frozen, "quant_type", "nf4"))
    if not fits:
        raise ValueError(f"{fmt} cannot hold this layer's stored codes ({layer.extra_repr()})")
    if not is_merged(layer):
        raise ValueError("R, P are not the identity; merge the layer first")
    m, n = layer.out_features, layer.in_features
    rows = layer.R.inv_perm  # original row j is stored row inv_perm[j]
    if isinstance(frozen, Int8RowwiseWeight):  # stored Ψ_m W0 Ψ_nᵀ
        return {
            "weight": frozen.weight[rows][:, layer.P.inv_perm].contiguous(),
            "SCB": frozen.SCB[rows].contiguous(),
            "weight_format": torch.tensor(INT8_ROW_FORMAT, dtype=torch.uint8),
        }
    assert isinstance(frozen, Blockwise4bitWeight)  # stored Ψ_m W0, rows of n/64 whole blocks
    packed = frozen.weight.view(m, n // 2)[rows].reshape(-1, 1).contiguous()
    absmax = frozen.dequantized_absmax().view(m, n // frozen.blocksize)[rows].reshape(-1)
    q_abs, nested, nested_map, offset = _double_quantize_bnb(absmax)
    meta = {
        "quant_type": frozen.quant_type,
        "blocksize": frozen.blocksize,
        "dtype": str(frozen.dtype).removeprefix("torch."),
        "shape": [m, n],
        "nested_blocksize": 256,
        "nested_dtype": "float32",
        "nested_offset": offset,
    }
    return {
        "weight": packed,
        "weight.absmax": q_abs.contiguous(),
        "weight.quant_map": frozen.quant_map.float().contiguous(),
        "weight.nested_absmax": nested.contiguous(),
        "weight.nested_quant_map": nested_map.contiguous(),
        f"weight.quant_state.bitsandbytes__{frozen.quant_type}": q4.quant_state_to_tensor(meta),
    }


def merged_linear_state_dict(
    layer: POETXLinear,
    fmt: str,
    *,
    quant_type: str = "nf4",
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """The layer's effective weight ``R · W0 · P`` (original coordinates) as ``fmt`` stores it.

    Where ``fmt`` is the layer's own store (:func:`writes_stored_codes`: int8 → ``hf-bnb8``, 4-bit
    of ``quant_type`` → ``hf-bnb4``), the layer is first **merged in place** exactly as training
    merges it (:meth:`POETXLinear.merge_then_reinitialize`: fold ``R``, ``P`` in fp32, new
    permutations, re-quantize with the layer's own rounding policy; skipped when ``R = P = I``
    already), and its stored codes are written as they are (:func:`stored_codes_state_dict`), so
    the export equals the merged layer. Otherwise (``hf-bf16``, or another format than the store's)
    ``R · W0 · P`` is rounded once into ``fmt`` and the layer is left untouched.

    Args:
        layer: a POET-X(Q) layer (any ``bits``); modified in place as described.
        fmt: ``"hf-bf16"`` (``weight`` bf16 ``[m, n]``), ``"hf-bnb8"`` (:func:`bnb_int8_state_dict`)
            or ``"hf-bnb4"`` (:func:`bnb_4bit_state_dict` with ``quant_type``).
        quant_type: 4-bit code for ``hf-bnb4``.
        generator: RNG of the merge (permutations, stochastic rounding); default a fresh generator
            seeded with :data:`EXPORT_MERGE_SEED`, so exports are reproducible.

    Returns:
        Keys relative to the layer (``weight``..., plus ``bias`` in bf16 if the layer has one).

    Raises:
        ValueError: unknown ``fmt``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if writes_stored_codes(layer, fmt, quant_type):
        if not is_merged(layer):
            if generator is None:
                generator = torch.Generator().manual_seed(EXPORT_MERGE_SEED)
            layer.merge_then_reinitialize(generator)
        out = stored_codes_state_dict(layer, fmt)
    else:
        w = layer.effective_weight(torch.float32)
        if fmt == "hf-bf16":
            out = {"weight": w.to(torch.bfloat16)}
        elif fmt == "hf-bnb8":
            out = bnb_int8_state_dict(w)
        else:
            out = bnb_4bit_state_dict(w, quant_type)
    if layer.bias is not None:
        out["bias"] = layer.bias.detach().to(torch.bfloat16)
    return out


# --------------------------------------------------------------------------------------------
# A run directory
# --------------------------------------------------------------------------------------------


def save_run_artifacts(run_dir: Path, model: nn.Module, tokenizer: Any | None, eos_id: int) -> None:
    """Write what export needs beside the checkpoint: ``config.json`` and ``tokenizer/``.

    Args:
        run_dir: the run directory (exists).
        model: the transformers model being trained (its ``.config`` is saved).
        tokenizer: a ``tokenizers.Tokenizer`` or a transformers tokenizer; ``None`` for token data
            made without one (synthetic benchmarks), which writes no ``tokenizer/``.
        eos_id: id of the end-of-text token (used as ``eos_token`` of a wrapped tokenizer).
    """
    model.config.save_pretrained(str(run_dir))
    if tokenizer is None:
        return
    target = run_dir / TOKENIZER_DIR
    tmp = run_dir / f".{TOKENIZER_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    as_hf_tokenizer(tokenizer, eos_id).save_pretrained(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def as_hf_tokenizer(tokenizer: Any, eos_id: int) -> Any:
    """A transformers tokenizer for ``tokenizer`` (returned as is if it already is one).

    A ``tokenizers.Tokenizer`` is wrapped in ``PreTrainedTokenizerFast`` with its ``eos_id`` token
    as ``eos_token`` (and ``bos_token``/``unk_token`` unset), so ``AutoTokenizer`` reloads it.
    """
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    eos = tokenizer.id_to_token(eos_id)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos)


@dataclass
class LoadedRun:
    """A run directory read back: its recipe, the POET-X(Q) model and the tokenizer."""

    recipe: Recipe
    model: nn.Module  # transformers causal LM with POETXLinear layers, fp32, eval mode
    tokenizer: Any  # transformers tokenizer
    config: Any  # transformers PretrainedConfig


def _one_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = "; ".join(lines[1:] if len(lines) > 1 and lines[0].endswith(":") else lines)
    return text[:400]


def load_run(run_dir: str | Path, *, echo: Callable[[str], None] = print) -> LoadedRun:
    """Rebuild a finished run's model from ``run_dir`` (recipe.yaml + model.safetensors).

    The model is rebuilt from ``config.json`` (written by :func:`save_run_artifacts`; runs from
    before it was written fall back to the recipe's ``model`` section), converted with the
    recipe's ``poet`` section and loaded strictly from ``model.safetensors``.

    Raises:
        ExportError: not a run directory, a non-POET method, or a checkpoint that does not match
            (missing/corrupt 4-bit quant_state, wrong shapes).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from poetxq.model.surgery import build_llama, convert_to_poetx

    run = Path(run_dir)
    ckpt = run / "model.safetensors"
    if not run.is_dir() or not ckpt.is_file() or not (run / "recipe.yaml").is_file():
        if (run / "checkpoints").is_dir():  # an interrupted run: its checkpoints hold the model
            raise ExportError(
                f"'{run}' is a run that has not finished (no model.safetensors, only "
                f"checkpoints); finish it with 'poetxq train --resume {run}', then export it"
            )
        raise ExportError(
            f"'{run}' is not a finished run directory (needs recipe.yaml and model.safetensors); "
            "pass a directory written by 'poetxq quantize-and-train'"
        )
    try:
        recipe = load_recipe(run / "recipe.yaml")
    except RecipeError as exc:
        raise ExportError(f"{run}: {exc}") from None
    if recipe.method not in POET_METHODS:
        raise ExportError(
            f"{run} was trained with method {recipe.method!r}; export takes poetxq and poetx runs"
        )
    try:
        state = load_file(str(ckpt))
    except (SafetensorError, OSError) as exc:
        raise ExportError(f"cannot read {ckpt}: {_one_line(exc)}") from None
    bad = [k for k, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:  # a damaged file, or a run saved after diverging: never export it silently
        raise ExportError(
            f"{ckpt} holds NaN/inf values in {len(bad)} tensors (e.g. {bad[0]}); the file is "
            "damaged or the run diverged — export an earlier checkpoint's run instead"
        )
    if (run / CONFIG_FILE).is_file():
        try:
            config = AutoConfig.from_pretrained(str(run))
        except (OSError, ValueError) as exc:  # transformers' words for a damaged file
            raise ExportError(
                f"cannot read {run / CONFIG_FILE} ({_one_line(exc)}); the run directory is "
                f"damaged: restore the file, or delete it to rebuild the model from the run's "
                "recipe.yaml"
            ) from None
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        emb = state.get("model.embed_tokens.weight")
        if emb is None:
            raise ExportError(f"{ckpt} has no model.embed_tokens.weight; not a poetxq checkpoint")
        echo(f"note: {run} has no {CONFIG_FILE}; model rebuilt from the recipe's model section")
        model = build_llama(recipe.model, emb.shape[0])
        config = model.config
    convert_to_poetx(model, recipe.poet, generator=torch.Generator().manual_seed(0))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ExportError(f"{ckpt} does not match its recipe: {_one_line(exc)}") from None
    model.eval()
    return LoadedRun(recipe, model, _load_run_tokenizer(run, recipe, echo), config)


def _load_run_tokenizer(run: Path, recipe: Recipe, echo: Callable[[str], None]) -> Any:
    from transformers import AutoTokenizer

    if (run / TOKENIZER_DIR).is_dir():
        return AutoTokenizer.from_pretrained(str(run / TOKENIZER_DIR))
    # Runs from before tokenizer/ was saved: the data layer rebuilds it (from its cache).
    from poetxq.data import prepare_data

    echo(f"note: {run} has no {TOKENIZER_DIR}/; tokenizer rebuilt from the recipe's data section")
    data = prepare_data(recipe.data, recipe.train.seq_len, progress=False)
    return as_hf_tokenizer(data.tokenizer, data.eos_id)


def merged_state_dict(
    model: nn.Module,
    fmt: str,
    *,
    quant_type: str = "nf4",
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """The whole model's state dict with every POET-X(Q) layer merged and stored as ``fmt``.

    Each POET layer goes through :func:`merged_linear_state_dict` in module order with one
    generator (default: seeded with :data:`EXPORT_MERGE_SEED`), so layers whose own store ``fmt``
    holds are **merged in place**, as a training merge does; afterwards ``model`` computes exactly
    what the exported weights encode (up to the 4-bit double-quant statistics). Non-POET tensors
    (embeddings, norms, ``lm_head``) are cast to bf16.
    """
    if generator is None:
        generator = torch.Generator().manual_seed(EXPORT_MERGE_SEED)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, POETXLinear)}
    prefixes = tuple(name + "." for name in layers)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key.startswith(prefixes):
            continue
        out[key] = value.detach().to(torch.bfloat16) if value.is_floating_point() else value
    for name, layer in layers.items():
        sd = merged_linear_state_dict(layer, fmt, quant_type=quant_type, generator=generator)
        for k, v in sd.items():
            out[f"{name}.{k}"] = v
    return out


def decode_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our decoding of an exported state dict: every bnb-quantized weight as dense fp32.

    int8 entries (``X.weight`` int8 with ``X.SCB``) become ``CB · SCB / 127``; 4-bit entries
    (``X.weight`` with ``X.weight.quant_state.bitsandbytes__*``) are dequantized with the shape,
    code and block size their quant_state names (double quant included); other float tensors are
    cast to fp32. The result loads into the plain transformers model (no bitsandbytes needed).

    Raises:
        ValueError: a 4-bit entry whose quant_state is corrupt.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".weight." in key or key.endswith((".SCB", ".weight_format")):
            continue  # statistics, consumed with their weight below
        base = key.removesuffix("weight")
        qs = [k for k in state if k.startswith(key + ".quant_state.bitsandbytes__")]
        if value.dtype == torch.int8 and base + "SCB" in state:
            out[key] = quant_kernels.dequant_int8_rowwise(value, state[base + "SCB"])
        elif qs:
            meta = q4.quant_state_from_tensor(state[qs[0]])
            absmax = state[key + ".absmax"]
            if key + ".nested_absmax" in state:
                absmax = q4.double_dequantize_absmax(
                    absmax, state[key + ".nested_absmax"], state[key + ".nested_quant_map"],
                    torch.tensor(float(meta["nested_offset"])), int(meta["nested_blocksize"]),
                )  # fmt: skip
            out[key] = q4.dequantize_4bit_blockwise(
                value, absmax.float(), meta["quant_type"], int(meta["blocksize"]),
                tuple(meta["shape"]), torch.float32,
            )  # fmt: skip
        else:
            out[key] = value.float() if value.is_floating_point() else value
    return out


def _bnb_config(model: nn.Module, fmt: str, quant_type: str) -> dict[str, Any]:
    """transformers' serialized ``BitsAndBytesConfig`` for the exported layers."""
    from transformers import BitsAndBytesConfig

    converted = {name for name, m in model.named_modules() if isinstance(m, POETXLinear)}
    others = sorted(
        name for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name not in converted and name != "lm_head"
    )  # fmt: skip
    skip = ["lm_head", *others]
    if fmt == "hf-bnb8":
        cfg = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    else:
        cfg = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant_type,
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
            llm_int8_skip_modules=skip,
        )
    return cfg.to_dict()


def _check_out_dir(out: Path, overwrite: bool, run_dir: Path | None = None) -> None:
    if run_dir is not None:
        src, dst = run_dir.resolve(), out.resolve()
        if src == dst or src.is_relative_to(dst) or dst.is_relative_to(src):
            raise ExportError(
                f"output directory '{out}' overlaps the run directory '{run_dir}' (exporting there "
                "would replace the run); choose a directory outside the run"
            )
    if out.exists() and not out.is_dir():
        raise ExportError(f"'{out}' exists and is not a directory; choose another output directory")
    if out.is_dir() and any(out.iterdir()):
        previous = (out / "poetxq_export.json").is_file()  # --overwrite replaces exports only
        if not overwrite and previous:
            raise ExportError(
                f"output directory '{out}' holds a previous export; pass --overwrite to replace "
                "it or choose another directory"
            )
        if not previous:
            raise ExportError(
                f"output directory '{out}' exists, is not empty and holds no previous export "
                "(poetxq_export.json); choose an empty or new output directory"
            )
    if not out.parent.exists():
        raise ExportError(f"parent directory '{out.parent}' does not exist; create it first")


def export_run(
    run_dir: str | Path,
    fmt: str,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    quant_type: str | None = None,
    echo: Callable[[str], None] = print,
) -> Path:
    """Write ``run_dir`` as a Hugging Face model directory in ``fmt`` at ``out_dir``, atomically.

    The directory holds ``config.json`` (with ``quantization_config`` for the bnb formats),
    ``model.safetensors``, ``generation_config.json`` when the model has one, and the tokenizer
    files; ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads it. Everything is
    written into a temporary sibling directory first and renamed into place at the end, so a
    failed export leaves ``out_dir`` as it was. ``run_dir`` is only read: ``out_dir`` may not lie
    in it (or contain it), and the merges of ``hf-bnb8``/``hf-bnb4`` (module docstring) happen on
    the model in memory, with a generator seeded :data:`EXPORT_MERGE_SEED` (reproducible).

    Args:
        run_dir: a finished run directory.
        fmt: ``"hf-bf16"``, ``"hf-bnb8"`` or ``"hf-bnb4"``.
        out_dir: output directory; must be absent or empty unless ``overwrite``.
        overwrite: replace a non-empty ``out_dir`` that holds a previous export
            (``poetxq_export.json``); any other non-empty directory is refused.
        quant_type: 4-bit code for ``hf-bnb4`` (default: the run's ``poet.quant_type``).
        echo: where the summary line goes.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ExportError: bad format, unusable output directory or run directory (one line).
    """
    from poetxq.training.checkpoint import save_safetensors

    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    out = Path(out_dir).resolve()  # "." must name the directory, not build ".tmp" inside it
    _check_out_dir(out, overwrite, Path(run_dir))
    run = load_run(run_dir, echo=echo)
    model, config = run.model, run.config
    qt = quant_type or run.recipe.poet.quant_type
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, POETXLinear)]
    if fmt == "hf-bnb4":
        straddle = [n for n, m in layers if m.in_features % 64 and m.in_features % 16 == 0]
        if straddle:
            echo(
                f"warning: {len(straddle)} layers (e.g. {straddle[0]}) have in_features not a "
                "multiple of 64; on the CPU bitsandbytes 0.50.2 misreads such blocks or fails "
                "in the forward pass of the loaded model (expected fine on a GPU, not yet checked)"
            )
    tie = bool(getattr(config, "tie_word_embeddings", False))
    config = config.__class__.from_dict(config.to_dict())  # a copy we may edit
    config.dtype = torch.bfloat16
    if fmt != "hf-bf16":
        config.quantization_config = _bnb_config(model, fmt, qt)
    as_stored = [n for n, m in layers if writes_stored_codes(m, fmt, qt)]
    needs_merge = sum(1 for n, m in layers if writes_stored_codes(m, fmt, qt) and not is_merged(m))
    rounded = len(layers) - len(as_stored)
    if fmt != "hf-bf16" and as_stored and rounded:
        first = next(n for n, _ in layers if n not in set(as_stored))
        echo(
            f"note: {rounded} layers (e.g. {first}) are not stored as {fmt} holds them (another "
            "format or code, or in_features not a multiple of 64); their R·W0·P is rounded into "
            f"{fmt} afresh, one more rounding than the run's model"
        )
    state = merged_state_dict(model, fmt, quant_type=qt)  # merges `as_stored` layers in memory
    if tie:
        state.pop("lm_head.weight", None)

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            tmp.mkdir()
        except OSError as exc:
            raise ExportError(
                f"cannot write the export next to '{out}' ({exc.strerror or exc}); choose an "
                "output directory in a folder you can write"
            ) from None
        config.save_pretrained(str(tmp))
        gen_cfg = getattr(model, "generation_config", None)
        if gen_cfg is not None and getattr(model, "can_generate", lambda: False)():
            gen_cfg.save_pretrained(str(tmp))
        save_safetensors(state, tmp / "model.safetensors")
        run.tokenizer.save_pretrained(str(tmp))
        (tmp / "poetxq_export.json").write_text(
            json.dumps(
                {"run_dir": str(Path(run_dir).resolve()), "format": fmt,
                 "quant_type": qt if fmt == "hf-bnb4" else None, "layers_merged": len(layers),
                 "layers_stored_codes": len(as_stored), "layers_merged_as_training": needs_merge,
                 "merge_seed": EXPORT_MERGE_SEED},
                indent=2,
            ),
            encoding="utf-8",
        )  # fmt: skip
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    kind = {"hf-bf16": "bf16", "hf-bnb8": "int8 row-wise (Linear8bitLt)",
            "hf-bnb4": f"{qt.upper()} blocksize 64, double quant (Linear4bit)"}[fmt]  # fmt: skip
    if as_stored:
        how = (
            f"{len(as_stored)} POET layers merged as a training merge does ({needs_merge} had "
            "R, P != I) and their stored codes written un-permuted"
            + (f", {rounded} rounded afresh from R·W0·P" if rounded else "")
        )
    else:
        how = f"{len(layers)} POET layers' R·W0·P in original coordinates rounded once"
    echo(
        f"exported {run_dir} -> {out} ({fmt}): {how}, stored {kind}; other tensors bf16; "
        f"tokenizer included; {run_dir} not modified"
    )
    return out
