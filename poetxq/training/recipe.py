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
import copy
import os
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from poetxq.data import DataConfig
from poetxq.schema import StrictSection

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class RecipeError(ValueError):
    """A recipe file or override is invalid; the message is one line naming the fix."""


class _Section(StrictSection):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)


class ModelConfig(_Section):
    """Llama architecture (transformers ``LlamaConfig`` fields); vocab comes from the tokenizer.

    ``pretrained`` (``--model``): a transformers Llama-family checkpoint directory (or hub id) to
    continue from; its own config, weights and tokenizer are used and the other fields here are
    ignored (:mod:`poetxq.model.pretrained`).
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
    """POET-X(Q) settings (POET-X, arXiv 2603.05500; W0 in bitsandbytes' int8 / NF4 / FP4)."""

    bits: Literal[4, 8, 16] = 8  # 8 = POET-XQ int8 W0; 4 = NF4/FP4 W0; 16 = unquantized POET-X
    block_size: int = Field(64, ge=2)  # b
    merge_interval: int = Field(100, ge=1)  # T (steps between merge-then-reinitialize)
    variant: Literal["fast", "mem"] = "mem"
    neumann_terms: int = Field(3, ge=1)  # k
    requant: Literal["nearest", "stochastic"] = "nearest"
    quant_type: Literal["nf4", "fp4"] = "nf4"  # 4-bit code (bits = 4 only)
    double_quant: bool = True  # 4-bit: quantize absmax again (bitsandbytes compress_statistics)
    freeze_orthogonal: bool = False  # control: Q frozen at 0, only embeddings/norms/lm_head train
    # merge once more after the last step, so the final evaluation, model.safetensors and a
    # same-format export (hf-bnb8 of int8, hf-bnb4 of 4-bit) are one model, R = P = I
    merge_at_end: bool = False
    target_modules: list[str] = Field(default_factory=lambda: list(TARGET_MODULES))


#: an Adam moment coefficient: 1 or above never forgets (torch refuses it, GaLore would not)
Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimConfig(_Section):
    """AdamW with POET param groups, cosine schedule and post-merge clip re-warm."""

    lr: float = Field(5e-3, gt=0)  # embeddings, lm_head, norms
    poet_lr: float = Field(4e-3, gt=0)
    poet_lr_scale: float = Field(0.5, gt=0)  # Q params use poet_lr * poet_lr_scale
    weight_decay: float = Field(0.0, ge=0)  # on >= 2-D non-Q params
    betas: tuple[Beta, Beta] = (0.9, 0.999)  # Adam's beta1, beta2, each in [0, 1)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(20, ge=0)
    min_lr_ratio: float = Field(0.01, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0)  # 0 = no clipping (the GaLore/APOLLO scripts' default)
    clip_rewarm_steps: int = Field(10, ge=0)  # clip re-warmed 0.1x -> 1x after each merge
    # POET methods: 8 = bitsandbytes AdamW8bit (blockwise 8-bit moments for tensors of >= 4096
    # elements, fp32 below); 32 = torch AdamW (moments in the parameters' dtype)
    state_bits: Literal[8, 32] = 32


METHODS = ("poetxq", "poetx", "adamw", "galore", "apollo", "qgalore", "qapollo")
#: methods whose decoder linears become POET-X(Q) layers
POET_METHODS: tuple[str, ...] = ("poetxq", "poetx")
#: the methods whose micro-steps can replay a CUDA graph (``train.cuda_graph: true``); ``auto``
#: takes one for the POET methods only (:func:`poetxq.training.cudagraph.graph_wanted`)
GRAPH_METHODS: tuple[str, ...] = (*POET_METHODS, "adamw")
Method = Literal["poetxq", "poetx", "adamw", "galore", "apollo", "qgalore", "qapollo"]


class BaselineConfig(_Section):
    """Settings of the non-POET methods (GaLore, Q-GaLore, APOLLO; :mod:`poetxq.baselines`).

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
    eval_every: int = Field(150, ge=0)  # 0: validation at the start and the end only
    eval_max_batches: int | None = Field(None, gt=0)
    log_every: int = Field(10, gt=0)
    seed: int = 0
    output_dir: str = "runs"
    save_checkpoint: bool = True
    # whole-layer activation checkpointing (transformers activation_checkpointing_enable,
    # use_reentrant=False): each decoder layer keeps only its input and recomputes the rest
    gradient_checkpointing: bool = False
    save_every: int = Field(0, ge=0)  # full training checkpoint every N steps (0: only at exit)
    keep_last: int = Field(2, ge=1)  # checkpoints kept under <run>/checkpoints/
    # auto: bf16 autocast on a GPU (fp32 parameters), else fp32; bf16 (or autocast, the name
    # summary.json and bench record): autocast everywhere; bf16-true: bf16 parameters, no
    # autocast (poetxq.training.precision)
    precision: Literal["auto", "fp32", "bf16", "autocast", "bf16-true"] = "auto"
    # replay each micro-batch's forward+backward from one CUDA graph (poetxq.training.cudagraph):
    # CUDA, fixed shapes. auto: on for the POET methods on CUDA without gradient_checkpointing /
    # offload_activations / loss_chunk_tokens / optimizer_in_backward, and with several
    # processes unless grad_sync: ddp; else off (poetxq.training.cudagraph.graph_wanted); true (POET
    # methods and adamw) refuses what it cannot serve
    cuda_graph: bool | Literal["auto"] = "auto"
    # how the replicas of a multi-process run (torchrun / accelerate launch) average gradients.
    # ddp: DistributedDataParallel all-reduces them in buckets during backward; step: every
    # rank runs its own forward+backward (from its CUDA graph, if any) and the gradients are
    # all-reduced once per optimizer step (poetxq.training.distributed.all_reduce_float_grads),
    # which is what a CUDA graph needs (DDP's hooks run outside it). auto: step when the micro-steps
    # replay a CUDA graph (cuda_graph: auto takes it for the POET methods, see above) or the
    # loss is chunked (loss_chunk_tokens), else ddp. One process: no effect
    grad_sync: Literal["auto", "ddp", "step"] = "auto"
    # CUDA: RMSNorm and the rotary embedding compiled by torch.compile into fused kernels
    # (poetxq.model.fuse; the first step compiles). auto: on, except with gradient_checkpointing
    # outside a CUDA graph, where the recomputed compiled calls cost more host time than the
    # fused kernels save (poetxq.model.fuse.fuse_wanted); ignored on a CPU
    fuse_elementwise: bool | Literal["auto"] = "auto"
    # keep the checkpointed layer inputs in pinned host memory (needs gradient_checkpointing;
    # poetxq.training.lowmem.enable_activation_checkpointing)
    offload_activations: bool = False
    # update each parameter as soon as its gradient is complete, then free the gradient
    # (poetxq.training.lowmem.OptimizerInBackward): no gradient clipping, no accumulation. With
    # cuda_graph: true (POET methods, optim.state_bits: 8) the updates are captured inside the
    # graph's backward (poetxq.training.graph_optim)
    optimizer_in_backward: bool = False
    # cross-entropy over chunks of this many tokens, logits recomputed in backward and never
    # held whole (poetxq.training.loss); 0: one [tokens, vocab] logits tensor as usual
    loss_chunk_tokens: int = Field(0, ge=0)

    def memory_options(self) -> list[str]:
        """The memory settings that are on, e.g. ``["gradient_checkpointing",
        "loss_chunk_tokens=256"]`` (``summary.json``, ``poetxq report``)."""
        on = [k for k in ("gradient_checkpointing", "offload_activations",
                          "optimizer_in_backward") if getattr(self, k)]  # fmt: skip
        return on + (
            [f"loss_chunk_tokens={self.loss_chunk_tokens}"] if self.loss_chunk_tokens else []
        )


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
    # what validation adjusted, one line each, for the run's log (not part of the recipe)
    _notes: list[str] = PrivateAttr(default_factory=list)

    @property
    def notes(self) -> list[str]:
        """Adjustments validation made that the user should see (e.g. a raised
        ``model.max_position_embeddings``); :func:`poetxq.training.train.train` prints them as
        notes."""
        return list(self._notes)

    def add_note(self, note: str) -> None:
        """Append ``note`` to :attr:`notes` (once)."""
        if note not in self._notes:
            self._notes.append(note)

    def _check_memory_options(self) -> None:
        """``train.offload_activations`` / ``optimizer_in_backward`` / ``loss_chunk_tokens``:
        what they need (every unmet need in one message)."""
        tc = self.train
        if tc.offload_activations and not tc.gradient_checkpointing:
            raise ValueError(
                "train.offload_activations moves the checkpointed layer inputs to the host; "
                "set train.gradient_checkpointing: true as well (or offload_activations: false)"
            )
        if not tc.optimizer_in_backward:
            return
        if self.method not in ("poetxq", "poetx", "adamw"):
            raise ValueError(
                f"train.optimizer_in_backward applies to poetxq, poetx and adamw, not {self.method}"
            )
        needs = [
            f"train.grad_accum: 1 (not {tc.grad_accum}; one update per backward)"
            if tc.grad_accum != 1 else "",
            f"optim.grad_clip: 0 (not {self.optim.grad_clip}; no global gradient norm exists "
            "when a parameter is updated)" if self.optim.grad_clip else "",
            # inside a graph the update reads lr and step from the device: our 8-bit AdamW
            # (poetxq.training.graph_optim); the POET methods only, whose optimizer that is
            "optim.state_bits: 8 (the CUDA graph captures the 8-bit AdamW update; or "
            "train.cuda_graph: false)"
            if tc.cuda_graph is True and self.optim.state_bits != 8 else "",
        ]  # fmt: skip
        needs = [n for n in needs if n]
        if needs:
            raise ValueError("train.optimizer_in_backward needs " + " and ".join(needs))

    @model_validator(mode="after")
    def _block_fits(self) -> Recipe:
        m = self.model
        smallest = min(m.hidden_size, m.intermediate_size)
        if self.method == "poetx" and self.poet.bits != 16:
            self.poet.bits = 16
        if m.pretrained is not None:
            _check_pretrained(self)
        elif self.method in POET_METHODS and self.poet.block_size > smallest:
            raise ValueError(
                f"poet.block_size {self.poet.block_size} exceeds the smallest layer dimension "
                f"{smallest}; choose a block size <= {smallest}"
            )
        if m.max_position_embeddings < self.train.seq_len:
            if m.pretrained is None:  # a checkpoint's own limit is checked where it is read
                note = (
                    f"train.seq_len {self.train.seq_len} exceeds model.max_position_embeddings "
                    f"{m.max_position_embeddings}; the model is built with "
                    f"max_position_embeddings {self.train.seq_len} (trained from scratch at "
                    "that length)"
                )
                if note not in self._notes:
                    self._notes.append(note)
            m.max_position_embeddings = self.train.seq_len
        if self.train.cuda_graph is True and self.method not in GRAPH_METHODS:
            raise ValueError(
                f"train.cuda_graph applies to the POET methods and adamw, not {self.method}; "
                "set train.cuda_graph: false or auto"
            )
        tc = self.train
        if tc.cuda_graph is True and self.method not in POET_METHODS and tc.optimizer_in_backward:
            raise ValueError(  # the update the graph captures is POET's 8-bit AdamW
                f"train.cuda_graph with train.optimizer_in_backward applies to the POET "
                f"methods (the graph captures their 8-bit update), not {self.method}; set "
                "train.cuda_graph: false"
            )
        self._check_memory_options()
        if self.train.precision == "bf16-true" and self.method not in (*POET_METHODS, "adamw"):
            raise ValueError(
                f"train.precision bf16-true applies to poetxq, poetx and adamw, not "
                f"{self.method} (the GaLore / APOLLO optimizers and int8 weights are not built "
                "for bf16 parameters here); use auto or bf16"
            )
        if self.optim.state_bits == 8 and self.method not in POET_METHODS:
            raise ValueError(
                f"optim.state_bits 8 applies to the POET methods; for {self.method} keep 32 "
                "(Q-GaLore's 8-bit states are baseline.state_bits)"
            )
        notes = _unused_settings(self)
        if self.optim.warmup_steps >= self.train.max_steps:
            notes.append(
                f"optim.warmup_steps {self.optim.warmup_steps} >= train.max_steps "
                f"{self.train.max_steps}: the learning rate rises for the whole run and never "
                "reaches optim.lr; lower optim.warmup_steps for a short run"
            )
        for note in notes:
            if note not in self._notes:
                self._notes.append(note)
        for section in ("poet", "baseline"):
            if not getattr(self, section).target_modules:
                raise ValueError(
                    f"{section}.target_modules is empty; list one or more of {TARGET_MODULES}"
                )
        unknown = (set(self.poet.target_modules) | set(self.baseline.target_modules)) - set(
            TARGET_MODULES
        )
        if unknown:
            raise ValueError(
                f"unknown target module(s) {sorted(unknown)}; allowed {TARGET_MODULES}"
            )
        return self


def _unused_settings(recipe: Recipe) -> list[str]:
    """Notes for settings the recipe's method ignores: ``poet.*`` away from its defaults under a
    baseline, ``baseline.*`` under a POET method (a recipe file may carry both sections)."""
    poet = recipe.method in POET_METHODS
    section, default = ("baseline", BaselineConfig()) if poet else ("poet", POETConfig())
    given = getattr(recipe, section)
    keys = [
        f"{section}.{k}={getattr(given, k)!r}"
        for k in type(given).model_fields
        if getattr(given, k) != getattr(default, k)
    ]
    if not keys:
        return []
    users = "the baselines" if poet else "poetxq and poetx"
    return [
        f"{', '.join(keys)}: no effect with method {recipe.method} ({section}.* applies to "
        f"{users} only)"
    ]


def _check_pretrained(recipe: Recipe) -> None:
    """``model.pretrained`` set: POET methods only; the tokenizer defaults to the checkpoint's."""
    if recipe.method not in POET_METHODS:
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


def _source_of(key: str, provenance: dict[str, str] | None, default: str) -> str:
    """The file that set ``key`` (or the closest enclosing key) per ``provenance``; for a whole
    section (an error between its keys), every file and override that set keys in it."""
    if not provenance:
        return default
    parts = key.split(".")
    for i in range(len(parts), 0, -1):  # the key itself, then its enclosing sections
        hit = provenance.get(".".join(parts[:i]))
        if hit is not None:
            return hit
    inner = sorted({v for k, v in provenance.items() if k.startswith(key + ".")})
    return ", ".join(inner) if inner else default


def format_validation_error(
    err: ValidationError, source: str, provenance: dict[str, str] | None = None
) -> str:
    """One line per problem: ``<file>: key 'a.b': <message> (allowed keys: ...)``.

    Args:
        err: pydantic's error for a whole recipe tree.
        source: the recipe as the user named it (used when no provenance applies).
        provenance: dotted key -> the file (or override) that set it, from composition.
    """
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        src = _source_of(key, provenance, source) if loc else source
        if e["type"] == "extra_forbidden":
            keys = _allowed_keys(Recipe, loc) + (["base", "by_model"] if len(loc) == 1 else [])
            allowed = ", ".join(keys)
            lines.append(f"{src}: unknown key '{key}' (allowed keys here: {allowed})")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            if not loc or isinstance(e.get("input"), dict):  # a whole section: do not dump it
                lines.append(f"{src}: {'' if not loc else f'key {key!r}: '}{msg}")
                continue
            got = repr(e.get("input"))
            got = got if len(got) <= 80 else got[:77] + "..."
            lines.append(f"{src}: key '{key}': {msg} (got {got})")
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
    if not key.strip():
        raise RecipeError(f"override '{text}' has no key before '='; write section.key=value")
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


def merge_overrides(flags: dict[str, tuple[str, Any]], sets: Iterable[str]) -> dict[str, Any]:
    """The recipe overrides of a command line: its flags, then its ``--set KEY=VALUE`` texts.

    Args:
        flags: recipe key -> (the flag as typed, e.g. ``"--bits"``, its value), for the flags
            given.
        sets: the ``--set`` texts, in order (a later one of the same key wins).

    Returns:
        dict: recipe key -> value.

    Raises:
        RecipeError: a ``--set`` names a key a flag also sets, with another value (which one
            should win is the user's call, not ours), or a malformed ``--set``.
    """
    out = {key: value for key, (_, value) in flags.items()}
    for text in sets:
        key, value = parse_override(text)
        if key in flags and flags[key][1] != value:
            flag, given = flags[key]
            raise RecipeError(
                f"--set {text} conflicts with {flag} {given} (both set {key}); give only one"
            )
        out[key] = value
    return out


#: reserved top-level keys of a recipe file, consumed by composition (never reach the schema)
BASE_KEY = "base"
BY_MODEL_KEY = "by_model"


def recipes_dir() -> Path:
    """Where ``MODEL:METHOD`` shorthands are looked up: ``$POETXQ_RECIPES`` or the repo's
    ``recipes/`` (next to the ``poetxq`` package in a source checkout)."""
    env = os.environ.get("POETXQ_RECIPES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "recipes"


def _names(folder: Path) -> str:
    found = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
    return ", ".join(found) or f"none (no {folder})"


def _shorthand(spec: str) -> list[Path] | None:
    """``llama-60m:poetxq`` -> [recipes/models/llama-60m.yaml, recipes/methods/poetxq.yaml];
    None when ``spec`` is not of that form (or is an existing file)."""
    if ":" not in spec or Path(spec).exists() or "/" in spec or "\\" in spec:
        return None
    model, _, method = spec.partition(":")
    root = recipes_dir()
    paths = [root / "models" / f"{model}.yaml", root / "methods" / f"{method}.yaml"]
    for kind, name, path in (("model", model, paths[0]), ("method", method, paths[1])):
        if not path.is_file():
            raise RecipeError(
                f"recipe '{spec}': unknown {kind} '{name}'; available {kind}s: "
                f"{_names(path.parent)} (MODEL:METHOD, e.g. llama-60m:poetxq)"
            )
    return paths


def _leaves(tree: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _leaves(v, key + ".")
        else:
            yield key


def _merge(tree: dict[str, Any], prov: dict[str, str], other: dict[str, Any], label: str) -> None:
    """Deep-merge ``other`` into ``tree`` (mappings merge, anything else replaces) and record
    ``label`` as the source of every leaf ``other`` sets."""

    def rec(dst: dict[str, Any], src: dict[str, Any], prefix: str) -> None:
        for k, v in src.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and isinstance(dst.get(k), dict):
                rec(dst[k], v, key + ".")
                continue
            dst[k] = copy.deepcopy(v)
            for old in [p for p in prov if p == key or p.startswith(key + ".")]:
                del prov[old]
            if isinstance(v, dict) and v:
                prov.update({leaf: label for leaf in _leaves(v, key + ".")})
            else:
                prov[key] = label

    rec(tree, other, "")


def _apply_by_model(tree: dict[str, Any], prov: dict[str, str]) -> None:
    """Consume ``by_model``: once the tree has a ``name``, merge ``by_model[name]`` (if any)."""
    table = tree.get(BY_MODEL_KEY)
    if table is None or "name" not in tree:
        return
    label = prov.get(f"{BY_MODEL_KEY}.{tree['name']}") or next(
        (v for k, v in prov.items() if k.startswith(f"{BY_MODEL_KEY}.{tree['name']}.")),
        "by_model",
    )
    del tree[BY_MODEL_KEY]
    for k in [k for k in prov if k == BY_MODEL_KEY or k.startswith(BY_MODEL_KEY + ".")]:
        del prov[k]
    entry = table.get(tree["name"])
    if entry:
        _merge(tree, prov, entry, f"{label} (by_model.{tree['name']})")


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (plain YAML keeps the
    last one silently, so a recipe would not say what it does)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _read_mapping(path: Path, included_from: str | None) -> dict[str, Any]:
    where = f" (base of {included_from})" if included_from else ""
    if path.is_dir():
        raise RecipeError(f"recipe path '{path}'{where} is a directory; pass a YAML file")
    if not path.exists():
        shipped = recipes_dir().parent / path
        if not path.is_absolute() and path.parts[:1] == ("recipes",) and shipped.is_file():
            fix = f"the shipped one is '{shipped}' (relative paths start in the current folder)"
        else:
            fix = "pass an existing YAML file"
        raise RecipeError(f"recipe file '{path}'{where} does not exist; {fix}")
    try:
        loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        msg = f"{path}: not valid YAML ({exc.__class__.__name__}: {exc})"
        raise RecipeError(" ".join(msg.split())) from exc
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: not UTF-8 text; a recipe is a UTF-8 YAML file") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if loaded is None:  # an empty file (or only comments) is a mistake, not "all defaults"
        raise RecipeError(
            f"{path}{where}: the file is empty; a recipe holds at least one section (model, "
            "poet, optim, data, train) or a 'base' to start from"
        )
    if not isinstance(loaded, dict):
        raise RecipeError(
            f"{path}: a recipe must be a mapping of sections, got {type(loaded).__name__}"
        )
    return loaded


def _compose(
    loaded: dict[str, Any], label: str, base_dir: Path, stack: tuple[Path, ...]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Resolve ``base`` (paths relative to ``base_dir``), then ``by_model``, then own keys."""
    own = dict(loaded)
    bases = own.pop(BASE_KEY, None)
    if bases is None:
        bases = []
    elif isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise RecipeError(
            f"{label}: key 'base' must be a path or a list of paths (relative to the file), "
            f"got {bases!r}"
        )
    by_model = own.get(BY_MODEL_KEY)
    if by_model is not None and not (
        isinstance(by_model, dict) and all(isinstance(v, dict) for v in by_model.values())
    ):
        raise RecipeError(
            f"{label}: key 'by_model' must map model names (e.g. llama-60m) to overrides, "
            f"got {by_model!r}"
        )
    tree: dict[str, Any] = {}
    prov: dict[str, str] = {}
    for b in bases:
        path = (base_dir / b).resolve()
        if path in stack:
            chain = " -> ".join(str(p) for p in (*stack, path))
            raise RecipeError(f"{label}: recipe bases form a cycle ({chain}); remove one 'base'")
        sub, sub_prov = _compose(_read_mapping(path, label), str(path), path.parent, (*stack, path))
        _merge(tree, prov, sub, "")
        prov.update({k: v for k, v in sub_prov.items() if k in set(_leaves(sub))})
    _apply_by_model(tree, prov)
    _merge(tree, prov, own, label)
    return tree, prov


def compose_recipe_tree(
    path: str | Path | None, overrides: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, str], str]:
    """The recipe as a plain tree after composition, before validation.

    Composition (documented in README "Recipes"): a file may name ``base:`` files (a path or a
    list, relative to the file); they are deep-merged in order, then the method file's
    ``by_model[<name>]`` overrides for the composed model ``name`` are applied, then the file's own
    keys. ``path`` may also be the shorthand ``MODEL:METHOD`` (``recipes/models/MODEL.yaml`` +
    ``recipes/methods/METHOD.yaml``). Overrides (``{"train.max_steps": 50}``) come last.

    Returns:
        ``(tree, provenance, source)``: the merged mapping, dotted leaf key -> the file or
        override that set it, and the recipe's display name.

    Raises:
        RecipeError: missing file, bad YAML, bad ``base``/``by_model``, unknown shorthand name.
    """
    tree: dict[str, Any] = {}
    prov: dict[str, str] = {}
    source = "default recipe"
    if path is not None:
        source = str(path)
        parts = _shorthand(str(path))
        if parts is not None:
            loaded: dict[str, Any] = {BASE_KEY: [str(p) for p in parts]}
            tree, prov = _compose(loaded, source, Path.cwd(), ())
        else:
            p = Path(path)
            tree, prov = _compose(_read_mapping(p, None), str(p), p.parent, (p.resolve(),))
    if BY_MODEL_KEY in tree:  # never met a model name: not applicable
        del tree[BY_MODEL_KEY]
        for k in [k for k in prov if k == BY_MODEL_KEY or k.startswith(BY_MODEL_KEY + ".")]:
            del prov[k]
    for key, value in (overrides or {}).items():
        _set_dotted(tree, key, value)  # an explicit None (``--set key=``) sets null
        shown = value  # as YAML reads it: null, true/false (1 stays 1)
        if value is None or isinstance(value, bool):
            shown = "null" if value is None else str(value).lower()
        prov[key] = f"override {key}={shown}"
    return tree, prov, source


def load_recipe(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Recipe:
    """Load a recipe (file, ``MODEL:METHOD`` shorthand, or the embedded default when ``path`` is
    None), compose its ``base`` files and apply overrides.

    Args:
        path: YAML file (read with ``yaml.safe_load``), ``MODEL:METHOD``, or None.
        overrides: ``{"train.max_steps": 50, ...}``; a ``None`` value sets the key to null.

    Returns:
        The validated :class:`Recipe`.

    Raises:
        RecipeError: missing/unreadable file, bad YAML, unknown key or invalid value (one line,
            naming the file that set the offending key).
    """
    for key in overrides or {}:
        if key.split(".")[0] in ("base", "by_model"):
            raise RecipeError(
                f"override {key}: 'base' and 'by_model' compose recipe files and are read from a "
                "file only; write them in a recipe YAML and pass it with --recipe"
            )
    tree, prov, source = compose_recipe_tree(path, overrides)
    try:
        return Recipe.model_validate(tree)
    except ValidationError as exc:
        if overrides:
            source += " (with overrides " + ", ".join(f"{k}={v}" for k, v in overrides.items())
            source += ")"
        raise RecipeError(format_validation_error(exc, source, prov)) from None


METHOD_LABELS = ("poetxq4", "poetxq", "poetx", "qgalore", "qapollo", "galore", "apollo", "adamw")


def poet_variant(recipe: Recipe) -> str | None:
    """The POET layer variant a recipe trains (``mem`` or ``fast``), None for the baselines."""
    return recipe.poet.variant if recipe.method in POET_METHODS else None


def method_label(recipe: Recipe) -> str:
    """Short label of what a recipe trains: ``poetxq`` (int8 W0), ``poetxq4`` (4-bit W0),
    ``poetx`` (unquantized W0) or the baseline's method name."""
    if recipe.method == "poetxq":
        return {8: "poetxq", 4: "poetxq4"}.get(recipe.poet.bits, "poetx")
    return recipe.method


def run_label(recipe: Recipe) -> str:
    """``<recipe name without a method suffix>-<method label>``, e.g. ``llama-60m-qgalore``;
    ``tiny-poetxq`` trained with ``--method adamw`` gives ``tiny-adamw``."""
    base = recipe.name
    for label in sorted(METHOD_LABELS, key=len, reverse=True):
        if base.endswith("-" + label):
            base = base[: -len(label) - 1]
            break
    return f"{base}-{method_label(recipe)}"


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML text (round-trips through :func:`load_recipe`)."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
