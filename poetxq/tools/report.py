"""Comparison report over run directories: a Markdown results table and PNG plots.

A run directory (written by :func:`poetxq.training.train.train`) holds ``recipe.yaml`` (the resolved
recipe), ``metrics.jsonl`` (one JSON object per line: ``step`` and ``loss`` / ``val_ppl`` /
``tokens_per_s`` ...) and ``summary.json`` (:class:`poetxq.training.train.TrainResult`). A run
without ``summary.json`` (killed or still running: it has ``metrics.jsonl`` and maybe checkpoints)
is reported from ``metrics.jsonl`` and marked ``interrupted (no summary.json)``. The report puts
runs of the same model (recipe name without its method suffix) side by side, in a fixed method
order, and writes into ``out_dir``:

* ``report.md`` — results table (run, method, weight bits, final val ppl, tokens/s, peak
  memory, train tokens, wall time, precision and memory plan where a run records them, memory
  options) and the plots;
* ``loss.png``, ``val_ppl.png`` — training loss and validation perplexity against tokens;
* ``throughput.png``, ``peak_memory.png`` — bars per run.

Plots use matplotlib's ``Agg`` backend (no display needed). Every file is written atomically.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from poetxq.model.diagnostics import DIAG_KEYS, REQUANT_KEY
from poetxq.paths import unwritable_reason
from poetxq.text import count
from poetxq.training.precision import run_precision
from poetxq.training.recipe import METHOD_LABELS, POET_METHODS, Recipe, method_label, run_label

METHOD_ORDER = ("poetxq", "poetxq4", "poetx", "qgalore", "qapollo", "galore", "apollo", "adamw")
PLOTS = ("loss.png", "val_ppl.png", "throughput.png", "peak_memory.png")
#: where ``poetxq report`` writes without ``-o`` (relative: under the current directory)
DEFAULT_REPORT_DIR = "report"
#: how a run without summary.json is marked in the table
NO_SUMMARY = "interrupted (no summary.json)"


class ReportError(ValueError):
    """A run directory is missing or unreadable; the message names the directory and file."""


#: how the report's table names the memory settings (TrainConfig.memory_options)
_SHORT = {"gradient_checkpointing": "checkpointing", "offload_activations": "offload",
          "optimizer_in_backward": "optimizer in backward",
          "offload_optimizer": "optimizer offload"}  # fmt: skip


def _memory_options(run: Run) -> str:
    names = [
        f"chunked loss ({o.split('=')[1]})" if o.startswith("loss_chunk_tokens=") else _SHORT[o]
        for o in run.recipe.train.memory_options()
    ]
    if run.recipe.optim.state_bits == 8:  # bitsandbytes' blockwise 8-bit Adam moments
        names.append("8-bit states")
    return ", ".join(names) or "-"


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
        recorded); None where ``recipe.yaml`` has no ``train.precision`` (an older run)."""
        train = self.recipe_tree.get("train")
        if not isinstance(train, dict) or "precision" not in train:
            return None
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
    def peak_memory(self) -> tuple[int | None, str]:
        """(bytes, kind): CUDA peak allocated, else the process's peak RSS, else (None, '')."""
        cuda = self.summary.get("peak_memory_bytes")
        if cuda is not None:
            return int(cuda), "GPU"
        rss = self.summary.get("peak_rss_bytes")
        return (int(rss), "RSS") if rss is not None else (None, "")


def _merges(run: Run) -> str:
    """``"N merges, "`` for a POET run (merge-then-reinitialize), ``""`` for the baselines."""
    if run.recipe.method not in POET_METHODS:
        return ""
    return f"{count(run.summary.get('merges', 'n/a'), 'merge')}, "


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
        raise ReportError(
            f"run directory '{p}' has no recipe.yaml (not a poetxq run); pass run directories "
            "made by poetxq train"
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
    return Run(p, recipe, summary, metrics, has_summary=has_summary, recipe_tree=tree)


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


def _order(run: Run) -> tuple[str, int, str]:
    m = run.method
    return (run.model, METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER), run.name)


def _fmt_bytes(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _fmt_seconds(s: float | None) -> str:
    if s is None:
        return "n/a"
    return f"{s:.0f} s" if s < 3600 else f"{s / 3600:.2f} h"


def _fmt_number(x: Any) -> str:
    """``x`` with two decimals, or ``n/a`` for a missing / non-finite value."""
    return f"{x:.2f}" if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def results_rows(runs: list[Run]) -> list[dict[str, str]]:
    """One table row (strings) per run, in report order."""
    rows = []
    for run in sorted(runs, key=_order):
        s = run.summary
        mem, kind = run.peak_memory
        ppl = s.get("final_val_ppl")
        name = f"{run.name} — {run.stopped}" if run.stopped else run.name
        if s.get("resumed_from"):  # its tokens/s and wall time cover the last session only
            name += f" (resumed at step {', '.join(map(str, s['resumed_from']))})"
        rows.append({
            "model": run.model, "run": name, "method": run.method, "bits": run.bits,
            "final val ppl": _fmt_number(ppl),
            "tokens/s": f"{s['tokens_per_s']:,.0f}" if "tokens_per_s" in s else "n/a",
            "peak memory": _fmt_bytes(mem) + (f" ({kind})" if kind == "RSS" else ""),
            "train tokens": f"{s['tokens']:,}" if "tokens" in s else "n/a",
            "wall time": _fmt_seconds(s.get("train_seconds")),
            "precision": run.precision or "-", "memory plan": run.plan or "-",
            "memory options": _memory_options(run),
        })  # fmt: skip
    return rows


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _plots(runs: list[Run], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(runs, key=_order)
    models = sorted({r.model for r in runs})

    def curves(key: str, fname: str, ylabel: str, logy: bool) -> None:
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
        for ax, model in zip(axes[0], models):
            for run in (r for r in runs if r.model == model):
                tps = run.summary.get("tokens", 0) / max(run.summary.get("steps", 1), 1)
                pts = [(m["step"] * tps, m[key]) for m in run.metrics if m.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o" if len(pts) < 20 else None, ms=3,
                            label=f"{run.method} ({run.name})")  # fmt: skip
            ax.set_title(model)
            ax.set_xlabel("training tokens")
            ax.set_ylabel(ylabel)
            if logy:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            if ax.get_lines():  # a run without logged steps draws nothing (and no legend)
                ax.legend(fontsize=8)
        fig.tight_layout()
        _atomic_write(out / fname, lambda p: fig.savefig(p, dpi=110, format="png"))
        plt.close(fig)

    def bars(values: list[float | None], fname: str, ylabel: str) -> None:
        fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(runs)), 4))
        labels = bar_labels(runs)
        heights = [v if v is not None else 0.0 for v in values]
        bars_ = ax.bar(range(len(runs)), heights, color=[f"C{_order(r)[1]}" for r in runs])
        for rect, v in zip(bars_, values):
            ax.annotate("n/a" if v is None else f"{v:,.3g}", (rect.get_x() + rect.get_width() / 2,
                        rect.get_height()), ha="center", va="bottom", fontsize=8)  # fmt: skip
        ax.set_xticks(range(len(runs)), labels, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        _atomic_write(out / fname, lambda p: fig.savefig(p, dpi=110, format="png"))
        plt.close(fig)

    if _has_diagnostics(runs):
        _diagnostics_plot(runs, out, plt)
    curves("loss", "loss.png", "training loss (nats)", logy=False)
    curves("val_ppl", "val_ppl.png", "validation perplexity", logy=True)
    bars([r.summary.get("tokens_per_s") for r in runs], "throughput.png", "tokens / s")
    mem = [r.peak_memory for r in runs]
    kinds = {k for _, k in mem if k}
    bars([None if b is None else b / 2**30 for b, _ in mem], "peak_memory.png",
         "peak memory (GiB" + (", " + "/".join(sorted(kinds)) if kinds else "") + ")")  # fmt: skip


def _has_diagnostics(runs: list[Run]) -> bool:
    """Whether any run logged ``train.diagnostics_every`` records."""
    return any(m.get("diag_orth_error") is not None for r in runs for m in r.metrics)


def _diagnostics_plot(runs: list[Run], out: Path, plt: Any) -> None:
    """``diagnostics.png``: the ``diag_*`` records of every run that logged them, per step."""
    panels = (
        (("diag_sigma_drift_init", "diag_sigma_drift_w0"), "singular-value drift (rel.)", True),
        (("diag_orth_error", REQUANT_KEY), "‖GᵀG − I‖₂; W0 re-quantization error", True),
        (("diag_energy",), "hyperspherical energy", False),
        (("diag_cos_median", "diag_cos_min"), "cosine to initial direction", False),
    )
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (keys, ylabel, logy) in zip(axes.flat, panels, strict=True):
        for i, run in enumerate(r for r in runs if any(k in m for m in r.metrics for k in keys)):
            for key, style in zip(keys, ("-", "--"), strict=False):
                pts = [(m["step"], m[key]) for m in run.metrics if m.get(key) is not None]
                if logy:
                    pts = [(x, max(y, 1e-12)) for x, y in pts]
                if pts:
                    ax.plot(*zip(*pts), style, color=f"C{i}", marker=".", ms=3,
                            label=f"{run.name}: {key.removeprefix('diag_')}")  # fmt: skip
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
    fig.suptitle("POET layers against exact POET (train.diagnostics_every)")
    fig.tight_layout()
    _atomic_write(out / "diagnostics.png", lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)


def bar_labels(runs: list[Run]) -> list[str]:
    """One bar label per run: model and method, and the run's folder name where two runs would
    otherwise share a label (runs of one recipe and method, e.g. seeds or settings)."""
    labels = [f"{r.model}\n{r.method}" for r in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{label}\n{r.name}" for label, r in zip(labels, runs, strict=True)]
    return labels


def build_report(run_dirs: list[str | Path], out_dir: str | Path) -> Path:
    """Read ``run_dirs`` and write ``report.md`` and the PNG plots into ``out_dir``.

    Returns:
        The path of ``report.md``.

    Raises:
        ReportError: no run given, or a run directory is missing/unreadable (nothing is written).
    """
    if not run_dirs:
        raise ReportError("no run directories given; pass one or more runs/<name> directories")
    if importlib.util.find_spec("matplotlib") is None:
        raise ReportError("poetxq report needs matplotlib: pip install -e '.[report]'")
    given: dict[Path, str | Path] = {}
    repeated: list[str] = []
    for p in run_dirs:  # a run given twice is reported once, under the path first given
        if Path(p).resolve() in given:
            repeated.append(str(p))
        given.setdefault(Path(p).resolve(), p)
    runs = [read_run(p) for p in given.values()]  # all read before anything is written
    mark_shapes(runs)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ReportError(f"'{out}' exists and is not a directory; choose another -o")
    if (out / "recipe.yaml").is_file() or (out / "checkpoints").is_dir():
        raise ReportError(f"'{out}' is a run directory; write the report elsewhere (-o DIR)")
    if (why := unwritable_reason(out)) is not None:
        raise ReportError(f"cannot write '{out}': {why}; choose another -o")
    out.mkdir(parents=True, exist_ok=True)
    _plots(runs, out)
    rows = results_rows(runs)
    # precision and memory plan: only where a run records them (older run directories do not)
    extra = [c for c, has in (("precision", any(r.precision for r in runs)),
                              ("memory plan", any(r.plan for r in runs))) if has]  # fmt: skip
    cols = ["run", "method", "bits", "final val ppl", "tokens/s", "peak memory", "train tokens",
            "wall time", *extra, "memory options"]  # fmt: skip
    lines = ["# Results", ""]
    lines.append(
        f"{count(len(runs), 'run')}; runs of the same model (recipe name and shape) are side by "
        "side. Peak memory is "
        "`torch.cuda.max_memory_allocated` on a GPU, the process's peak RSS (marked) on the CPU."
    )
    if repeated:
        lines.append(
            "Given more than once and reported once: " + ", ".join(f"`{p}`" for p in repeated) + "."
        )
    for model in sorted({r["model"] for r in rows}):
        lines += ["", f"## {model}", "", "| " + " | ".join(cols) + " |",
                  "|" + "|".join("---" for _ in cols) + "|"]  # fmt: skip
        lines += ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows if r["model"] == model]
    lines += ["", "## Plots", ""]
    titles = {"loss.png": "Training loss", "val_ppl.png": "Validation perplexity",
              "throughput.png": "Throughput", "peak_memory.png": "Peak memory"}  # fmt: skip
    for name in PLOTS:
        lines += [f"![{titles[name]}]({name})", ""]
    if _has_diagnostics(runs):  # _plots drew diagnostics.png
        lines += ["![Diagnostics (train.diagnostics_every)](diagnostics.png)", ""]
    lines += ["## Runs", ""]
    for run in sorted(runs, key=_order):
        s = run.summary
        ppl0, ppl = (_fmt_number(s.get(k)) for k in ("initial_val_ppl", "final_val_ppl"))
        why = run.stopped + ("" if run.has_summary else "; read from metrics.jsonl")
        stopped = f" ({why})" if why else ""
        lines.append(
            f"- `{run.path}`: {s.get('steps', 'n/a')} steps on {s.get('device', 'n/a')}, "
            f"{_merges(run)}val ppl {ppl0} -> {ppl}{stopped}"
        )
    text = "\n".join(lines) + "\n"
    path = out / "report.md"
    _atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))
    return path


__all__ = ["DEFAULT_REPORT_DIR", "METHOD_LABELS", "NO_SUMMARY", "PLOTS", "ReportError", "Run",
           "build_report", "read_run", "results_rows", "summary_from_metrics"]  # fmt: skip
