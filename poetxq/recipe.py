"""Training recipes: a validated schema, YAML loading and ``key=value`` overrides.

A recipe is plain data (YAML): a ``method`` (``poetxq`` by default, or a baseline) and six
sections — ``model``, ``poet``, ``optim``, ``train``, ``data``, ``baseline`` — validated by
pydantic with unknown keys forbidden. The defaults of this schema *are* the embedded default
recipe (a tiny Llama on the embedded English corpus, sized to finish in under three minutes on
2 CPU cores); ``recipes/tiny/poetxq.yaml`` spells the same values out.

Errors are reported as one line naming the file, the key and what is allowed
(:class:`RecipeError`).
"""

from __future__ import annotations

import contextlib
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from poetxq.data import DataConfig

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class RecipeError(ValueError):
    """A recipe file or override is invalid; the message is one line naming the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """Llama architecture (transformers ``LlamaConfig`` fields); vocab comes from the tokenizer.

    ``pretrained`` (``--model``): a transformers Llama-family checkpoint directory (or hub id) to
    continue from; its own config, weights and tokenizer are used and the other fields here are
    ignored (:mod:`poetxq.pretrained`).
    """

    pretrained: str | None = None

    hidden_size: int = Field(256, gt=0)
    intermediate_size: int = Field(704, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_hidden_layers: int = Field(4, gt=0)
    num_key_value_heads: int | None = None
    max_position_embeddings: int = Field(1024, gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    initializer_range: float = Field(0.02, gt=0)
    tie_word_embeddings: bool = False

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        kv = self.num_key_value_heads
        if kv is not None and (kv <= 0 or self.num_attention_heads % kv):
            raise ValueError(
                f"num_key_value_heads {kv} must be positive and divide num_attention_heads "
                f"{self.num_attention_heads}"
            )
        return self


class POETConfig(_Section):
    """POET-X(Q) settings (DESIGN.md §1–2)."""

    bits: Literal[4, 8, 16] = 8  # 8 = POET-XQ int8 W0; 4 = NF4/FP4 W0; 16 = unquantized POET-X
    block_size: int = Field(64, ge=2)  # b
    merge_interval: int = Field(100, ge=1)  # T (steps between merge-then-reinitialize)
    variant: Literal["fast", "mem"] = "mem"
    neumann_terms: int = Field(3, ge=1)  # k
    requant: Literal["nearest", "stochastic"] = "nearest"
    quant_type: Literal["nf4", "fp4"] = "nf4"  # 4-bit code (bits = 4 only)
    double_quant: bool = True  # 4-bit: quantize absmax again (bitsandbytes compress_statistics)
    freeze_orthogonal: bool = False  # control: Q frozen at 0, only embeddings/norms/lm_head train
    target_modules: list[str] = Field(default_factory=lambda: list(TARGET_MODULES))


class OptimConfig(_Section):
    """AdamW with POET param groups, cosine schedule and post-merge clip re-warm."""

    lr: float = Field(5e-3, gt=0)  # embeddings, lm_head, norms
    poet_lr: float = Field(4e-3, gt=0)
    poet_lr_scale: float = Field(0.5, gt=0)  # Q params use poet_lr * poet_lr_scale
    weight_decay: float = Field(0.0, ge=0)  # on >= 2-D non-Q params
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(20, ge=0)
    min_lr_ratio: float = Field(0.01, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0)  # 0 = no clipping (the GaLore/APOLLO scripts' default)
    clip_rewarm_steps: int = Field(10, ge=0)  # clip re-warmed 0.1x -> 1x after each merge


METHODS = ("poetxq", "poetx", "adamw", "galore", "apollo", "qgalore", "qapollo")
Method = Literal["poetxq", "poetx", "adamw", "galore", "apollo", "qgalore", "qapollo"]


class BaselineConfig(_Section):
    """Settings of the non-POET methods (DESIGN.md §3; :mod:`poetxq.baselines`).

    ``None`` means the method's default: ``scale`` 0.25 for galore/qgalore and 1.0 for
    apollo/qapollo; ``weight_group_size`` 256 for qgalore and 128 for qapollo.
    """

    rank: int = Field(128, ge=1)  # r (clamped to min(out, in) of each weight)
    update_proj_gap: int = Field(200, ge=1)
    scale: float | None = Field(None, gt=0)
    scale_type: Literal["channel", "tensor"] = "channel"  # APOLLO; tensor = APOLLO-Mini
    norm_growth_limit: float = Field(1.01, ge=1)  # APOLLO's limiter gamma
    proj_bits: Literal[4, 32] = 4  # qgalore: INT4 projection matrices
    proj_group_size: int = Field(256, ge=1)
    state_bits: Literal[8, 32] = 8  # qgalore: 8-bit blockwise Adam states for the low-rank moments
    lazy_update: bool = True  # qgalore: lazy layer-adaptive subspace refresh
    cos_threshold: float = Field(0.4, ge=-1, le=1)
    gamma_proj: int = Field(2, ge=1)
    queue_size: int = Field(5, ge=1)
    weight_group_size: int | None = Field(None, ge=1)  # qgalore / qapollo int8 weights
    stochastic_round: bool = True
    seed: int = 0  # APOLLO projection seeds and the stochastic-rounding noise
    target_modules: list[str] = Field(default_factory=lambda: list(TARGET_MODULES))


class TrainConfig(_Section):
    """Loop settings. ``batch_size`` is per micro-batch; tokens/step = batch*accum*seq_len."""

    max_steps: int = Field(300, gt=0)
    batch_size: int = Field(8, gt=0)
    grad_accum: int = Field(1, gt=0)
    seq_len: int = Field(128, gt=1)
    eval_every: int = Field(150, gt=0)
    eval_max_batches: int | None = Field(None, gt=0)
    log_every: int = Field(10, gt=0)
    seed: int = 0
    output_dir: str = "runs"
    save_checkpoint: bool = True


class Recipe(_Section):
    """A whole training recipe. ``Recipe()`` is the embedded default."""

    name: str = "tiny-poetxq"
    method: Method = "poetxq"  # poetx = POET-X with unquantized W0 (forces poet.bits = 16)
    model: ModelConfig = Field(default_factory=ModelConfig)
    poet: POETConfig = Field(default_factory=POETConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    baseline: BaselineConfig = Field(default_factory=BaselineConfig)

    @model_validator(mode="after")
    def _block_fits(self) -> Recipe:
        m = self.model
        smallest = min(m.hidden_size, m.intermediate_size)
        if self.method == "poetx" and self.poet.bits != 16:
            self.poet.bits = 16
        if m.pretrained is not None:
            _check_pretrained(self)
        elif self.method in ("poetxq", "poetx") and self.poet.block_size > smallest:
            raise ValueError(
                f"poet.block_size {self.poet.block_size} exceeds the smallest layer dimension "
                f"{smallest}; choose a block size <= {smallest}"
            )
        if m.max_position_embeddings < self.train.seq_len:
            m.max_position_embeddings = self.train.seq_len
        unknown = (set(self.poet.target_modules) | set(self.baseline.target_modules)) - set(
            TARGET_MODULES
        )
        if unknown:
            raise ValueError(
                f"unknown target module(s) {sorted(unknown)}; allowed {TARGET_MODULES}"
            )
        return self


def _check_pretrained(recipe: Recipe) -> None:
    """``model.pretrained`` set: POET methods only; the tokenizer defaults to the checkpoint's."""
    if recipe.method not in ("poetxq", "poetx"):
        raise ValueError(
            f"model.pretrained (--model) works with methods poetxq and poetx, not {recipe.method!r}"
        )
    if recipe.data.tokenizer.strip() == "bpe":  # the default: use the checkpoint's tokenizer
        recipe.data.tokenizer = recipe.model.pretrained  # type: ignore[assignment]


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section that ``loc`` (minus its last item) points into."""
    cls: Any = model
    for part in loc[:-1]:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return []
        cls = field.annotation
        for arg in typing.get_args(cls) or ():
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                cls = arg
    return list(getattr(cls, "model_fields", {}))


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem: ``<source>: key 'a.b': <message> (allowed keys: ...)``."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(_allowed_keys(Recipe, loc))
            lines.append(f"{source}: unknown key '{key}' (allowed keys here: {allowed})")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{source}: key '{key}': {msg} (got {e.get('input')!r})")
    return "; ".join(lines)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise RecipeError(f"override '{dotted}': '{p}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``key.path=value``; the value is read as YAML (``1e-3``, ``true``, ``[a, b]``)."""
    if "=" not in text:
        raise RecipeError(
            f"override '{text}' must look like section.key=value (e.g. train.max_steps=50)"
        )
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise RecipeError(
            f"override '{text}': value is not valid YAML ({exc.__class__.__name__})"
        ) from None
    if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
        with contextlib.suppress(ValueError):
            value = float(value)
    return key.strip(), value


def load_recipe(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Recipe:
    """Load a recipe YAML (or the embedded default when ``path`` is None) and apply overrides.

    Args:
        path: YAML file (read with ``yaml.safe_load``) or None.
        overrides: ``{"train.max_steps": 50, ...}``; a ``None`` value sets the key to null.

    Returns:
        The validated :class:`Recipe`.

    Raises:
        RecipeError: missing/unreadable file, bad YAML, unknown key or invalid value (one line).
    """
    tree: dict[str, Any] = {}
    source = "default recipe"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise RecipeError(f"recipe file '{p}' does not exist; pass an existing YAML file")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise RecipeError(f"{p}: not valid YAML ({exc.__class__.__name__}: {exc})") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise RecipeError(
                f"{p}: a recipe must be a mapping of sections, got {type(loaded).__name__}"
            )
        tree = loaded
    for key, value in (overrides or {}).items():
        _set_dotted(tree, key, value)  # an explicit None (``--set key=``) sets null
    try:
        return Recipe.model_validate(tree)
    except ValidationError as exc:
        if overrides:
            source += " (with overrides " + ", ".join(f"{k}={v}" for k, v in overrides.items())
            source += ")"
        raise RecipeError(format_validation_error(exc, source)) from None


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML text (round-trips through :func:`load_recipe`)."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
