"""The model side's recipe sections: ``model`` (the Llama architecture, or a pretrained
checkpoint) and ``poet`` (POET-X(Q) settings). The recipe (:mod:`poetxq.training.recipe`) holds
them with the other sections and checks how they combine."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import Field, field_validator, model_validator

from poetxq.schema import Section, check_path_key

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_block_size(block_size: int, dims: Iterable[int | None], where: str = "") -> None:
    """The one check of the POET block-size bound: ``poet.block_size`` ``b`` must not exceed
    the smallest of ``dims`` (the widths of the layers a run converts). The recipe schema
    (its own model section), a ``--model`` checkpoint's config
    (:func:`poetxq.model.pretrained.check_pretrained_config`), surgery (each target linear) and
    the orthogonal parametrization (its dimension) all call it, so the bound and its message
    live here.

    Args:
        block_size: ``b``.
        dims: the layer widths; None entries (unknown) are skipped, none known skips the check.
        where: what the widths belong to, appended after the smallest (e.g. `` of 'ckpt'``).

    Raises:
        ValueError: ``block_size`` exceeds the smallest width (one line, with the fix).
    """
    smallest = min((d for d in dims if isinstance(d, int)), default=None)
    if smallest is not None and block_size > smallest:
        raise ValueError(
            f"poet.block_size {block_size} exceeds the smallest layer dimension {smallest}"
            f"{where}; choose a block size <= {smallest} (--block-size {smallest})"
        )


class ModelConfig(Section):
    """Llama architecture (transformers ``LlamaConfig`` fields); vocab comes from the tokenizer.

    ``pretrained`` (``--model``): a transformers Llama-family checkpoint directory (or hub id) to
    continue from; its own config, weights and tokenizer are used and the other fields here are
    ignored (:mod:`poetxq.model.pretrained`). A directory is relative to the working directory
    (not to the recipe file), checked as every path key is (:func:`poetxq.schema.check_path_key`).
    """

    pretrained: str | None = None

    hidden_size: int = Field(256, gt=0)
    intermediate_size: int = Field(704, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_hidden_layers: int = Field(4, gt=0)
    num_key_value_heads: int | None = None
    #: per-head width; None: hidden_size / num_attention_heads (Llama). Qwen3 and some Mistral
    #: checkpoints set it apart (then q_proj has num_attention_heads * head_dim rows, not hidden)
    head_dim: int | None = Field(None, gt=0)
    max_position_embeddings: int = Field(1024, gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    initializer_range: float = Field(0.02, gt=0)
    tie_word_embeddings: bool = False

    @field_validator("pretrained")
    @classmethod
    def _pretrained_path(cls, value: str | None) -> str | None:
        check_path_key(value)
        return value

    @property
    def head_width(self) -> int:
        """The per-head width: ``head_dim``, else ``hidden_size // num_attention_heads``."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelConfig:
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads} (set model.head_dim for another per-head width)"
            )
        if self.head_width % 2:  # rotary embeddings turn pairs of each head's features
            fix = "set model.head_dim to an even width"
            if not self.head_dim:
                fix = "choose hidden_size and num_attention_heads so that their quotient is even"
            raise ValueError(
                f"the per-head width {self.head_width} is odd, and rotary position embeddings "
                f"need an even one; {fix}"
            )
        kv = self.num_key_value_heads
        if kv is not None and (kv <= 0 or self.num_attention_heads % kv):
            raise ValueError(
                f"num_key_value_heads {kv} must be positive and divide num_attention_heads "
                f"{self.num_attention_heads}"
            )
        return self


class POETConfig(Section):
    """POET-X(Q) settings (POET-X, arXiv 2603.05500; W0 in bitsandbytes' int8 / NF4 / FP4)."""

    bits: Literal[4, 8, 16] = 8  # 8 = POET-XQ int8 W0; 4 = NF4/FP4 W0; 16 = unquantized POET-X
    block_size: int = Field(64, ge=2)  # b
    merge_interval: int = Field(100, ge=1)  # T (steps between merge-then-reinitialize)
    variant: Literal["fast", "mem"] = "mem"
    neumann_terms: int = Field(3, ge=1)  # k
    requant: Literal["nearest", "stochastic"] = "nearest"
    quant_type: Literal["nf4", "fp4"] = "nf4"  # 4-bit code (bits = 4 only)
    double_quant: bool = True  # 4-bit: quantize absmax again (bitsandbytes compress_statistics)
    # block: POET-BS, every b x b block of R and P trains; full: POET-FS, one b x b block per side
    # rotates a random subset of b coordinates, drawn again at each merge (arXiv 2506.08001 §3.2)
    structure: Literal["block", "full"] = "block"
    freeze_orthogonal: bool = False  # control: Q frozen at 0, only embeddings/norms/lm_head train
    # merge once more after the last step, so the final evaluation, model.safetensors and a
    # same-format export (hf-bnb8 of int8, hf-bnb4 of 4-bit) are one model, R = P = I
    merge_at_end: bool = False
    # the GEMMs against W0 (quant_kernels.KernelPolicy.w0_gemm, docs/KERNELS.md): bf16 =
    # dequantize W0 to the activation dtype inside the GEMM; int8 = quantize the activations per
    # token and multiply int8 by int8 on the tensor cores (int8 W0 only; a CPU runs the
    # plain-torch reference); auto = bf16 until the int8 path's speed and quality are measured
    gemm: Literal["auto", "bf16", "int8"] = "auto"
    target_modules: list[str] = Field(default_factory=lambda: list(TARGET_MODULES))

    @model_validator(mode="after")
    def _format_keys_fit_bits(self) -> POETConfig:
        """The W0-format keys need the bits they describe: ``quant_type`` and ``double_quant``
        describe a 4-bit W0, ``requant`` the rounding of a quantized one (bits 8 or 4). A key at
        its default passes (a saved ``recipe.yaml`` spells every key out); one set to another
        value under the wrong bits is refused, whether it came from YAML, ``--set`` or a flag."""
        if self.quant_type != "nf4" and self.bits != 4:
            raise ValueError(
                f"poet.quant_type {self.quant_type} (--quant-type) applies to poet.bits 4 "
                f"(--bits 4) only, and this recipe has poet.bits {self.bits}; set poet.bits: 4 "
                "or drop poet.quant_type"
            )
        if not self.double_quant and self.bits != 4:
            raise ValueError(
                f"poet.double_quant false applies to poet.bits 4 (--bits 4) only, and this "
                f"recipe has poet.bits {self.bits}; set poet.bits: 4 or drop poet.double_quant"
            )
        if self.requant != "nearest" and self.bits == 16:
            raise ValueError(
                f"poet.requant {self.requant} (--requant) applies to a quantized W0 (poet.bits "
                "8 or 4, --bits 8 or 4), not to poet.bits 16; set poet.bits: 8 or drop "
                "poet.requant"
            )
        return self
