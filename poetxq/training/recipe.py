"""Training recipes: the validated schema, and every check of how its options combine.

A recipe is plain data (YAML): a ``method`` (``poetxq`` by default, or a baseline) and six
sections — ``model``, ``poet`` (:mod:`poetxq.model.config`), ``optim``, ``train``, ``data``
(:class:`poetxq.data.DataConfig`), ``baseline`` — validated by pydantic with unknown keys
forbidden. :class:`Recipe`'s own validator is the one place where the sections' combinations are
checked; it never changes a recipe: keys that follow from other keys (``method: poetx`` is
``poet.bits`` 16, ``model.max_position_embeddings`` at least ``train.seq_len``, a ``--model``
checkpoint's tokenizer and continued-training rates) are filled in at construction
(:func:`dependent_defaults`), with a note where the user should know. The defaults of this
schema *are* the embedded default recipe (a tiny Llama on the embedded English corpus, sized to
finish in under three minutes on 2 CPU cores); ``recipes/tiny/poetxq.yaml`` spells the same values
out. Files, composition and overrides are :mod:`poetxq.training.recipe_files`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    field_validator,
    model_validator,
)

from poetxq.data import DataConfig
from poetxq.model.config import TARGET_MODULES, ModelConfig, POETConfig, check_block_size
from poetxq.paths import NAME_RULE, name_problem
from poetxq.schema import Section, check_path_key


class RecipeError(ValueError):
    """A recipe file or override is invalid; the message is one line naming the fix."""


#: an Adam moment coefficient: 1 or above never forgets (torch refuses it, GaLore would not)
Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimConfig(Section):
    """AdamW with POET param groups, cosine schedule and post-merge clip re-warm."""

    lr: float = Field(5e-3, gt=0)  # embeddings, lm_head, norms (every method)
    # the baselines' hidden matrices (baseline.target_modules): AdamW's and Muon's lr, the
    # GaLore / APOLLO family's before its scale; None: optim.lr. The POET methods' matrix
    # knob is poet_lr (their W0 is frozen)
    matrix_lr: float | None = Field(None, gt=0)
    poet_lr: float = Field(4e-3, gt=0)
    poet_lr_scale: float = Field(0.5, gt=0)  # Q params use poet_lr * poet_lr_scale
    weight_decay: float = Field(0.0, ge=0)  # on >= 2-D non-Q params
    betas: tuple[Beta, Beta] = (0.9, 0.999)  # Adam's beta1, beta2, each in [0, 1)
    # the POET methods' Q group alone (the official POET code's AdamW keeps torch's
    # (0.9, 0.999) there); None: optim.betas
    poet_betas: tuple[Beta, Beta] | None = None
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(20, ge=0)
    min_lr_ratio: float = Field(0.01, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0)  # 0 = no clipping (the GaLore/APOLLO scripts' default)
    clip_rewarm_steps: int = Field(10, ge=0)  # clip re-warmed 0.1x -> 1x after each merge
    # POET methods: 8 = bitsandbytes AdamW8bit (blockwise 8-bit moments for tensors of >= 4096
    # elements, fp32 below); 32 = torch AdamW (moments in the parameters' dtype)
    state_bits: Literal[8, 32] = 32


METHODS = ("poetxq", "poetx", "adamw", "muon", "galore", "apollo", "qgalore", "qapollo")
#: methods whose decoder linears become POET-X(Q) layers
POET_METHODS: tuple[str, ...] = ("poetxq", "poetx")
#: the methods whose micro-steps can replay a CUDA graph (``train.cuda_graph: true``); ``auto``
#: takes one for the POET methods only (:func:`poetxq.training.cudagraph.graph_wanted`)
GRAPH_METHODS: tuple[str, ...] = (*POET_METHODS, "adamw")
Method = Literal["poetxq", "poetx", "adamw", "muon", "galore", "apollo", "qgalore", "qapollo"]


class BaselineConfig(Section):
    """Settings of the non-POET methods (GaLore, Q-GaLore, APOLLO;
    :mod:`poetxq.training.baseline_methods`).

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


class TrainConfig(Section):
    """Loop settings. ``batch_size`` is per micro-batch; tokens/step = batch*accum*seq_len.

    ``output_dir`` (``--output-dir``) is the one path here: the folder that holds the run
    directories, relative to the working directory (not to the recipe file), checked as every
    path key is (:func:`poetxq.schema.check_path_key`).
    """

    max_steps: int = Field(300, gt=0)
    batch_size: int = Field(8, gt=0)
    grad_accum: int = Field(1, gt=0)
    seq_len: int = Field(128, gt=1)
    eval_every: int = Field(150, ge=0)  # 0: validation at the start and the end only
    eval_max_batches: int | None = Field(None, gt=0)
    log_every: int = Field(10, gt=0)
    # POET methods: every N steps, the layers' drift from exact POET (poetxq.model.diagnostics:
    # spectrum drift, CNP orthogonality error, hyperspherical energy, neuron cosines to their
    # direction at the start of this process) as diag_* keys in metrics.jsonl; 0: off. Each
    # costs two SVDs per layer (seconds per layer at 8B: for small models or rare steps)
    diagnostics_every: int = Field(0, ge=0)
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
    # the memory plan (poetxq.training.memory): auto fits fastest / balanced / lowest to the
    # GPU's memory (on a CPU: fastest); a plan name fixes it. A plan sets only the memory keys
    # the recipe does not set itself
    memory: Literal["auto", "fastest", "balanced", "lowest"] = "auto"
    # keep the checkpointed layer inputs in pinned host memory (needs gradient_checkpointing;
    # poetxq.training.lowmem.enable_activation_checkpointing)
    offload_activations: bool = False
    # update each parameter as soon as its gradient is complete, then free the gradient
    # (poetxq.training.lowmem.OptimizerInBackward): no gradient clipping, no accumulation. With
    # cuda_graph: true (POET methods, optim.state_bits: 8) the updates are captured inside the
    # graph's backward (poetxq.training.graph_optim)
    optimizer_in_backward: bool = False
    # keep the gradients and optimizer states in pinned host memory; each parameter's share
    # comes to the GPU only for its update, after backward (poetxq.training.offload.HostOffload):
    # clipping and accumulation exact, one process, eager steps
    offload_optimizer: bool = False
    # cross-entropy over chunks of this many tokens, logits recomputed in backward and never
    # held whole (poetxq.training.loss); 0: one [tokens, vocab] logits tensor as usual
    loss_chunk_tokens: int = Field(0, ge=0)

    @field_validator("output_dir")
    @classmethod
    def _output_dir_path(cls, value: str) -> str:
        check_path_key(value)
        return value

    def memory_options(self) -> list[str]:
        """The memory settings that are on, e.g. ``["gradient_checkpointing",
        "loss_chunk_tokens=256"]`` (``summary.json``, ``poetxq report``)."""
        on = [k for k in ("gradient_checkpointing", "offload_activations",
                          "optimizer_in_backward", "offload_optimizer")
              if getattr(self, k)]  # fmt: skip
        return on + (
            [f"loss_chunk_tokens={self.loss_chunk_tokens}"] if self.loss_chunk_tokens else []
        )


class Recipe(Section):
    """A whole training recipe. ``Recipe()`` is the embedded default.

    ``name`` is not a path: it names the run directories (``<name>-<method>-<timestamp>`` under
    ``train.output_dir``) and must be one folder name (:func:`poetxq.paths.name_problem`). The
    path keys and what they are relative to: ``train.output_dir``, ``data.source``,
    ``data.tokenizer``, ``data.cache_dir`` and ``model.pretrained`` to the working directory;
    a recipe file's ``base`` to that file (:mod:`poetxq.training.recipe_files`).
    """

    name: str = "tiny-poetxq"
    method: Method = "poetxq"  # poetx = POET-X, unquantized W0 (poet.bits 16: dependent_defaults)
    model: ModelConfig = Field(default_factory=ModelConfig)
    poet: POETConfig = Field(default_factory=POETConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    baseline: BaselineConfig = Field(default_factory=BaselineConfig)
    # what validation adjusted, one line each, for the run's log (not part of the recipe)
    _notes: list[str] = PrivateAttr(default_factory=list)
    # the dotted keys an override set (load_recipe's overrides: a command-line flag or --set)
    _overridden: frozenset[str] = PrivateAttr(default_factory=frozenset)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        """One folder name (a run directory is named after it), never a path."""
        if (problem := name_problem(name)) is not None:
            raise ValueError(
                f"the recipe's name {problem}; {NAME_RULE}: give it one (e.g. name: my-run) "
                "and choose where runs go with --output-dir (train.output_dir)"
            )
        return name

    @property
    def overridden(self) -> frozenset[str]:
        """Dotted keys (``train.precision``) set by an override of :func:`load_recipe
        <poetxq.training.recipe_files.load_recipe>` (a command-line flag or ``--set``) rather
        than by a recipe file; empty for a recipe built otherwise."""
        return self._overridden

    def mark_overridden(self, keys: frozenset[str] | set[str]) -> None:
        """Record ``keys`` (dotted) as set by overrides (:attr:`overridden`)."""
        self._overridden = frozenset(keys)

    def __eq__(self, other: object) -> bool:
        """The same settings and notes: where a key was set (:attr:`overridden`) is not part of
        a recipe (a recipe with overrides equals its ``recipe.yaml`` read back)."""
        if not isinstance(other, Recipe):
            return NotImplemented
        return self.__dict__ == other.__dict__ and self._notes == other._notes

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
        """``train.offload_activations`` / ``optimizer_in_backward`` / ``offload_optimizer``:
        what they need (every unmet need in one message)."""
        tc = self.train
        if tc.offload_activations and not tc.gradient_checkpointing:
            raise ValueError(
                "train.offload_activations moves the checkpointed layer inputs to the host; "
                "set train.gradient_checkpointing: true as well (or offload_activations: false)"
            )
        if tc.offload_optimizer:
            if self.method not in ("poetxq", "poetx", "adamw"):
                raise ValueError(
                    f"train.offload_optimizer applies to poetxq, poetx and adamw, not "
                    f"{self.method}; set train.offload_optimizer: false"
                )
            if tc.optimizer_in_backward:
                raise ValueError(
                    "train.offload_optimizer and train.optimizer_in_backward are two ways to "
                    "keep gradients off the GPU; set one of them to false"
                )
            if tc.cuda_graph is True:
                raise ValueError(
                    "train.offload_optimizer runs eager steps; set train.cuda_graph: false "
                    "(or auto)"
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

    @model_validator(mode="wrap")
    @classmethod
    def _dependent_defaults(cls, data: Any, handler: ModelWrapValidatorHandler[Recipe]) -> Recipe:
        """Keys whose value follows from other keys, filled in at construction and never by
        changing a validated recipe: the input is validated, :func:`dependent_defaults` reads
        what follows from it, and where that differs the input with those keys filled in is
        validated once more (every check runs on the recipe that will train). The notes of the
        filled-in keys come first in :attr:`notes`."""
        recipe = handler(data)
        fills, notes = dependent_defaults(recipe)
        if not fills:
            return recipe
        tree = recipe.model_dump(exclude_unset=True)
        for key, value in fills.items():
            section, name = key.split(".")
            tree.setdefault(section, {})[name] = value
        filled = handler(tree)
        filled._notes[:0] = [n for n in notes if n not in filled._notes]
        filled._overridden = recipe._overridden
        return filled

    @model_validator(mode="after")
    def _block_fits(self) -> Recipe:
        """The checks across sections (each a one-line refusal naming the fix); nothing here
        changes the recipe (:meth:`_dependent_defaults` fills in what follows from other keys)."""
        m = self.model
        kv_heads = m.num_key_value_heads or m.num_attention_heads
        if self.method in POET_METHODS and self.poet.gemm == "int8" and self.poet.bits != 8:
            what = "NF4/FP4" if self.poet.bits == 4 else "unquantized"
            raise ValueError(
                f"poet.gemm: int8 needs an int8 W0 (poet.bits: 8); poet.bits {self.poet.bits} "
                f"({what}, method {self.method}) keeps the dequant GEMMs: set poet.gemm: auto"
            )
        if m.pretrained is not None:
            _check_pretrained(self)
        elif self.method in POET_METHODS:
            # the seven projections' widths: hidden, MLP, query/output heads, key/value heads
            check_block_size(self.poet.block_size, (
                m.hidden_size, m.intermediate_size, m.num_attention_heads * m.head_width,
                kv_heads * m.head_width,
            ))  # fmt: skip
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
        if self.optim.matrix_lr is not None and self.method in POET_METHODS:
            raise ValueError(
                f"optim.matrix_lr sets the baselines' matrix lr; {self.method} trains its "
                "matrices through the rotations at optim.poet_lr: remove optim.matrix_lr"
            )
        if self.optim.poet_betas is not None and self.method not in POET_METHODS:
            raise ValueError(
                f"optim.poet_betas sets the betas of the POET methods' rotations; {self.method} "
                "has none: remove optim.poet_betas (optim.betas applies to every group)"
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
    """``model.pretrained`` set: POET methods only (its tokenizer is a dependent default,
    :func:`dependent_defaults`)."""
    if recipe.method not in POET_METHODS:
        raise ValueError(
            f"model.pretrained (--model) works with methods poetxq and poetx, not {recipe.method!r}"
        )


def dependent_defaults(recipe: Recipe) -> tuple[dict[str, Any], list[str]]:
    """The keys of a validated ``recipe`` whose value follows from other keys, where they
    differ from what it holds, and the notes to print for them.

    * ``method: poetx`` trains an unquantized W0: ``poet.bits`` is 16 (whatever the file says;
      ``--method poetx`` on a ``bits: 8`` recipe file is the documented way to train POET-X).
    * ``model.max_position_embeddings`` is at least ``train.seq_len`` (a note for a model from
      scratch; a ``--model`` checkpoint's own limit is checked where it is read).
    * ``model.pretrained``: ``data.tokenizer`` left at ``bpe`` is the checkpoint's own, and the
      optimizer rates the recipe did not set are the continued-training defaults, with a note
      (:func:`poetxq.model.pretrained.continued_training_rates`).

    Returns:
        ``(fills, notes)``: dotted key -> value, and the notes (empty when nothing follows).
    """
    fills: dict[str, Any] = {}
    notes: list[str] = []
    m, tc = recipe.model, recipe.train
    if recipe.method == "poetx" and recipe.poet.bits != 16:
        fills["poet.bits"] = 16
    if m.max_position_embeddings < tc.seq_len:
        fills["model.max_position_embeddings"] = tc.seq_len
        if m.pretrained is None:
            notes.append(
                f"train.seq_len {tc.seq_len} exceeds model.max_position_embeddings "
                f"{m.max_position_embeddings}; the model is built with max_position_embeddings "
                f"{tc.seq_len} (trained from scratch at that length)"
            )
    if m.pretrained is not None and recipe.method in POET_METHODS:
        from poetxq.model.pretrained import continued_training_rates

        if recipe.data.tokenizer.strip() == "bpe":  # the default: the checkpoint's tokenizer
            fills["data.tokenizer"] = m.pretrained
        rates, note = continued_training_rates(recipe.optim)
        fills.update({f"optim.{k}": v for k, v in rates.items()})
        if note:
            notes.append(note)
    return fills, notes


METHOD_LABELS = (
    "poetxq4-fs", "poetxq-fs", "poetx-fs", "poetxq4", "poetxq", "poetx", "qgalore", "qapollo",
    "galore", "apollo", "adamw", "muon",
)  # fmt: skip


def poet_variant(recipe: Recipe) -> str | None:
    """The POET layer variant a recipe trains (``mem`` or ``fast``), None for the baselines."""
    return recipe.poet.variant if recipe.method in POET_METHODS else None


def method_label(recipe: Recipe) -> str:
    """Short label of what a recipe trains: ``poetxq`` (int8 W0), ``poetxq4`` (4-bit W0),
    ``poetx`` (unquantized W0), each with ``-fs`` for fully stochastic rotations
    (``poet.structure: full``), or the baseline's method name."""
    if recipe.method == "poetxq":
        label = {8: "poetxq", 4: "poetxq4"}.get(recipe.poet.bits, "poetx")
        return label + ("-fs" if recipe.poet.structure == "full" else "")
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
