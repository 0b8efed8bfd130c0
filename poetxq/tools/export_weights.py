"""Export's weights: POET-X(Q) layers as Hugging Face / bitsandbytes state dicts.

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

from typing import Any

import torch
from torch import nn

import quant_kernels
from poetxq.model.layer import POETXLinear
from poetxq.model.quant import INT8_ROW_FORMAT, Blockwise4bitWeight, Int8RowwiseWeight
from quant_kernels import reference_4bit as q4
from quant_kernels.reference_double_quant import double_dequantize_absmax

FORMATS: tuple[str, ...] = ("hf-bf16", "hf-bnb8", "hf-bnb4")


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
                absmax = double_dequantize_absmax(
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


def bnb_config(model: nn.Module, fmt: str, quant_type: str) -> dict[str, Any]:
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
