"""One ``poetxq train`` run directory, read: its resolved recipe, ``summary.json`` and
``metrics.jsonl`` as a :class:`Run` (:func:`read_run`), for :mod:`poetxq.tools.report`.

A run directory (written by :func:`poetxq.training.train.train`) holds ``recipe.yaml`` (the
resolved recipe), ``metrics.jsonl`` (one JSON object per line: ``step`` and ``loss`` /
``val_ppl`` / ``tokens_per_s`` ...) and ``summary.json``
(:class:`poetxq.training.train.TrainResult`). A run without ``summary.json`` (killed or still
running) is read from ``metrics.jsonl`` (:func:`summary_from_metrics`). Files may come from
anywhere: YAML through ``safe_load`` and the schema, numbers checked, one-line errors
(:class:`ReportError`).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from poetxq.model.diagnostics import DIAG_KEYS, REQUANT_KEY
from poetxq.training.precision import run_precision
from poetxq.training.recipe import POET_METHODS, Recipe, method_label, run_label
from poetxq.training.rundir import PLAN_FILE

#: how a run without summary.json is marked in the table
NO_SUMMARY = "interrupted (no summary.json)"


class ReportError(ValueError):
    """A run directory is missing or unreadable; the message names the directory and file."""


@dataclass
class Run:
    """One run directory, read."""

    path: Path
    recipe: Recipe
    summary: dict[str, Any]
    metrics: list[dict[str, Any]] = field(default_factory=list)
    has_summary: bool = True  # False: summary derived from metrics.jsonl (an interrupted run)
    # set by mark_shapes where runs of one recipe name differ in model shape, e.g. " (d 64, 2L)"
    shape_note: str = ""
    # recipe.yaml as read, before validation: which keys the run's version of poetxq wrote
    recipe_tree: dict[str, Any] = field(default_factory=dict)
    # plan.json as read (poetxq.training.plan.RunPlan.to_dict); empty for a run from before it
    run_plan: dict[str, Any] = field(default_factory=dict)

    @property
    def method(self) -> str:
        """The method label; a POET run with ``poet.freeze_orthogonal`` (``R = P = I``, only
        embeddings, norms and lm_head train) is marked as that control."""
        label = self.summary.get("method") or method_label(self.recipe)
        if self.recipe.method in POET_METHODS and self.recipe.poet.freeze_orthogonal:
            return f"{label}, R = P = I control"
        return label

    @property
    def stopped(self) -> str:
        """Why the run has no final evaluation (``""`` when it finished): ``diverged at step N``,
        ``stopped by SIGTERM`` or :data:`NO_SUMMARY`."""
        s = self.summary
        if s.get("diverged_at") is not None:
            return f"diverged at step {s['diverged_at']}"
        if not self.has_summary:
            return NO_SUMMARY
        if s.get("interrupted"):
            return f"stopped by {s.get('stop_signal') or 'a signal'}"
        return ""

    @property
    def model(self) -> str:
        """The recipe name without its method suffix, plus :attr:`shape_note` (runs with the
        same one share a table)."""
        label = run_label(self.recipe)
        return label[: -len(method_label(self.recipe)) - 1] + self.shape_note

    @property
    def shape(self) -> str:
        """The model's shape in a few words: ``d 64, 2 layers, MLP 136, 4 heads`` (or the
        checkpoint a ``--model`` run continued from)."""
        m = self.recipe.model
        if m.pretrained is not None:
            return f"from {m.pretrained}"
        return (
            f"d {m.hidden_size}, {m.num_hidden_layers} layers, MLP {m.intermediate_size}, "
            f"{m.num_attention_heads} heads"
        )

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def plan(self) -> str | None:
        """The memory plan the run took: ``summary.json`` ``memory_plan`` (``lowest (auto)``
        where ``train.memory: auto`` chose it), else ``recipe.yaml``'s resolved ``train.memory``
        (a run without a summary); None for a run from before memory plans."""
        plan = self.summary.get("memory_plan")
        if isinstance(plan, dict) and isinstance(plan.get("name"), str):
            auto = str(plan.get("chosen_by", "")).startswith("auto")
            return plan["name"] + (" (auto)" if auto else "")
        train = self.recipe_tree.get("train")
        named = train.get("memory") if isinstance(train, dict) else None
        return named if isinstance(named, str) and named != "auto" else None

    @property
    def precision(self) -> str | None:
        """How the run held its parameters and computed (``autocast``, ``bf16-true``, ``fp32``:
        :func:`~poetxq.training.precision.run_precision` of ``train.precision`` on the run's
        device), ``fp32 (auto)`` where ``auto`` chose it (plain ``auto`` where the device is not
        recorded); None where ``recipe.yaml`` has no ``train.precision`` (an older run). The
        run's ``plan.json`` says what it ran; a run from before plan.json is resolved again
        from its recipe and device."""
        train = self.recipe_tree.get("train")
        if not isinstance(train, dict) or "precision" not in train:
            return None
        planned = self.run_plan.get("precision")
        if isinstance(planned, str):
            return planned + (" (auto)" if train.get("precision") == "auto" else "")
        tc, device = self.recipe.train, self.summary.get("device")
        on = "cuda" if str(device).startswith("cuda") else "cpu"
        if tc.precision != "auto":
            return run_precision(tc, on)
        return f"{run_precision(tc, on)} (auto)" if device else "auto"

    @property
    def bits(self) -> str:
        """How the projection weights are stored (``int8 W0``, ``nf4 W0``, ``int8 g256``, ...)."""
        r = self.recipe
        dense = "bf16" if "bf16" in str(self.summary.get("device", "")) else "fp32"
        if r.method == "poetxq" and r.poet.bits == 8:
            return "int8 W0"
        if r.method == "poetxq" and r.poet.bits == 4:
            return f"{r.poet.quant_type} W0"
        if r.method in POET_METHODS:
            return f"{dense} W0"
        if r.method in ("qgalore", "qapollo"):
            g = r.baseline.weight_group_size or (256 if r.method == "qgalore" else 128)
            return f"int8 g{g}"
        return dense

    @property
    def last_val(self) -> tuple[int, float] | None:
        """``(step, val_ppl)`` of the last evaluation after step 0 in ``metrics.jsonl``, or None:
        what a run without a final evaluation (stopped, interrupted) reached."""
        logged = [(m["step"], m["val_ppl"]) for m in self.metrics
                  if isinstance(m.get("step"), int) and m["step"] > 0
                  and isinstance(m.get("val_ppl"), (int, float))]  # fmt: skip
        return logged[-1] if logged else None

    @property
    def peak_memory(self) -> tuple[int | None, str]:
        """(bytes, kind): CUDA peak allocated, else the process's peak RSS, else (None, '')."""
        cuda = self.summary.get("peak_memory_bytes")
        if cuda is not None:
            return int(cuda), "GPU"
        rss = self.summary.get("peak_rss_bytes")
        return (int(rss), "RSS") if rss is not None else (None, "")


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``; a torn last line (a killed writer) is skipped.

    Raises:
        json.JSONDecodeError: a bad line before the last. ReportError: a record that is not an
            object, or whose numeric fields (:data:`METRIC_NUMBERS`) hold something else.
    """
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise
    for i, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise ReportError(f"{path} record {i}: not a JSON object")
        _check_numbers(record, METRIC_NUMBERS, f"{path} record {i}")
    return records


#: fields report reads as numbers (null allowed): summary.json's, and metrics.jsonl's per record
SUMMARY_NUMBERS = (
    "steps",
    "tokens",
    "tokens_per_s",
    "train_seconds",
    "merges",
    "initial_val_ppl",
    "final_val_ppl",
    "unigram_val_ppl",
    "peak_memory_bytes",
    "peak_rss_bytes",
)
METRIC_NUMBERS = ("step", "loss", "val_ppl", "tokens", "tokens_per_s", *DIAG_KEYS, REQUANT_KEY)


def _check_numbers(record: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    """Raise :class:`ReportError` naming ``where`` and the key when one of ``keys`` holds
    something other than a number or null (a hand-edited or foreign file)."""
    for key in keys:
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ReportError(
                f"{where}: '{key}' is {value!r}, not a number; fix or remove the file"
            )


def summary_from_metrics(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``summary.json`` would say, as far as ``metrics.jsonl`` tells it (a run stopped
    without writing its summary): steps, tokens, mean logged tokens/s and the step-0 val ppl;
    no final evaluation, wall time, memory or device. A run that diverged (its ``diverged``
    event) gets ``diverged_at`` (the step) instead of ``interrupted``."""
    logged = [m for m in metrics if isinstance(m.get("step"), int)]
    steps = max((m["step"] for m in logged), default=0)
    tokens = [m["tokens"] for m in logged if isinstance(m.get("tokens"), (int, float))]
    rates = [m["tokens_per_s"] for m in logged if isinstance(m.get("tokens_per_s"), (int, float))]
    first = next((m for m in logged if m["step"] == 0 and "val_ppl" in m), {})
    diverged = next((m for m in logged if m.get("event") == "diverged"), None)
    summary: dict[str, Any] = {"steps": steps, "final_val_ppl": None, "interrupted": not diverged}
    if diverged is not None:  # train stopped on a NaN/inf loss and wrote no summary
        summary["diverged_at"] = diverged["step"]
    if tokens:
        summary["tokens"] = int(max(tokens))
    if rates:
        summary["tokens_per_s"] = sum(rates) / len(rates)
    if first.get("val_ppl") is not None:
        summary["initial_val_ppl"] = first["val_ppl"]
    return summary


def read_run(path: str | Path) -> Run:
    """Read one run directory. Without ``summary.json`` (an interrupted run) the summary is
    derived from ``metrics.jsonl`` (:func:`summary_from_metrics`) and ``has_summary`` is False.

    Raises:
        ReportError: the directory or ``recipe.yaml`` is missing, it has neither
            ``summary.json`` nor ``metrics.jsonl``, or a file is unreadable.
    """
    p = Path(path)
    if not p.is_dir():
        what = "is not a directory" if p.exists() else "does not exist"
        raise ReportError(f"run directory '{p}' {what}; pass directories made by poetxq train")
    files = {name: p / name for name in ("recipe.yaml", "summary.json", "metrics.jsonl")}
    if not files["recipe.yaml"].is_file():
        inside = sorted(c.name for c in p.iterdir() if (c / "recipe.yaml").is_file())
        hint = f" (it holds runs: pass {p / '*'})" if inside else ""
        raise ReportError(
            f"run directory '{p}' has no recipe.yaml (not a poetxq run{hint}); pass run "
            "directories made by poetxq train"
        )
    has_summary = files["summary.json"].is_file()
    if not has_summary and not files["metrics.jsonl"].is_file():
        raise ReportError(
            f"run directory '{p}' has neither summary.json nor metrics.jsonl (it never logged a "
            "step); pass run directories that trained"
        )
    try:
        tree = yaml.safe_load(files["recipe.yaml"].read_text(encoding="utf-8"))
        recipe = Recipe.model_validate(tree)
    except Exception as exc:  # yaml or schema error: one line naming the file and the first key
        first = " ".join(str(exc).split())[:200]
        raise ReportError(f"{files['recipe.yaml']}: unreadable recipe: {first}") from None
    name = "metrics.jsonl"
    try:
        metrics = _read_metrics(files[name]) if files[name].is_file() else []
        if has_summary:
            name = "summary.json"
            summary = json.loads(files[name].read_text(encoding="utf-8"))
            if not isinstance(summary, dict):
                raise ReportError(
                    f"{files[name]} holds a JSON {type(summary).__name__}, not the object train "
                    "writes; remove it to report the run from metrics.jsonl"
                )
        else:
            summary = summary_from_metrics(metrics)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"{files[name]}: bad JSON ({exc})") from None
    if has_summary:
        _check_numbers(summary, SUMMARY_NUMBERS, str(files["summary.json"]))
    run_plan: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):  # an older run has none; a torn one: unread
        loaded = json.loads((p / PLAN_FILE).read_text(encoding="utf-8"))
        run_plan = loaded if isinstance(loaded, dict) else {}
    return Run(
        p, recipe, summary, metrics, has_summary=has_summary, recipe_tree=tree, run_plan=run_plan
    )


def mark_shapes(runs: list[Run]) -> None:
    """Give each run whose recipe name it shares with a run of another model shape that shape
    as its :attr:`Run.shape_note`, so they go to separate tables and plots (``--set model.*``
    changes a model without renaming it)."""
    shapes: dict[str, set[str]] = {}
    for run in runs:
        run.shape_note = ""
        shapes.setdefault(run.model, set()).add(run.shape)
    for run in runs:
        if len(shapes[run.model]) > 1:
            run.shape_note = f" ({run.shape})"
