"""Comparison report over run directories: a Markdown results table and PNG plots.

The runs are read by :func:`poetxq.tools.run_dir.read_run` (a run without ``summary.json``,
killed or still running, is reported from ``metrics.jsonl`` and marked ``interrupted (no
summary.json)``). The report puts runs of the same model (recipe name without its method
suffix) side by side, in a fixed method order, and writes into ``out_dir``:

* ``report.md`` — results table (run, method, weight bits, final val ppl, tokens/s, peak
  memory, train tokens, wall time, precision and memory plan where a run records them, memory
  options) and the plots;
* ``loss.png``, ``val_ppl.png`` — training loss and validation perplexity against tokens;
* ``throughput.png``, ``peak_memory.png`` — bars per run (left out when no run has the value);

Plots use matplotlib's ``Agg`` backend (no display needed). Every file is written atomically.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poetxq.model.diagnostics import REQUANT_KEY
from poetxq.paths import unwritable_reason
from poetxq.text import count
from poetxq.tools.run_dir import NO_SUMMARY, ReportError, Run, mark_shapes, read_run
from poetxq.training.recipe import METHOD_LABELS, POET_METHODS

METHOD_ORDER = (
    "poetxq", "poetxq4", "poetx", "qgalore", "qapollo", "galore", "apollo", "adamw", "muon",
)  # fmt: skip
PLOTS = ("loss.png", "val_ppl.png", "throughput.png", "peak_memory.png")
#: where ``poetxq report`` writes without ``-o`` (relative: under the current directory)
DEFAULT_REPORT_DIR = "report"
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


def _merges(run: Run) -> str:
    """``"N merges, "`` for a POET run (merge-then-reinitialize), ``""`` for the baselines."""
    if run.recipe.method not in POET_METHODS:
        return ""
    return f"{count(run.summary.get('merges', 'n/a'), 'merge')}, "


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


def _final_ppl(run: Run) -> str:
    """The final validation perplexity; for a run without one, ``n/a`` and the last one it
    logged (``n/a (last 432.26 at step 40)``)."""
    ppl = run.summary.get("final_val_ppl")
    if ppl is None and run.last_val is not None:
        step, last = run.last_val
        return f"n/a (last {_fmt_number(last)} at step {step})"
    return _fmt_number(ppl)


#: settings whose difference makes perplexities measure different things (data, vocabulary,
#: context), then the generic training settings a fair comparison holds equal (issue 32's list)
DATA_KEYS = ("data.source", "data.vocab_size", "train.seq_len")
SETTING_KEYS = ("train.max_steps", "tokens per step", "optim.lr", "optim.warmup_steps",
                "optim.min_lr_ratio", "optim.betas", "optim.eps", "optim.weight_decay",
                "optim.grad_clip", "train.precision")  # fmt: skip


def _setting(run: Run, key: str) -> str:
    tc = run.recipe.train
    if key == "tokens per step":
        return f"{tc.batch_size * tc.grad_accum * tc.seq_len:,}"
    section, name = key.split(".")
    value = getattr(getattr(run.recipe, section), name)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(f"{v:g}" for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _differing_keys(runs: list[Run], keys: tuple[str, ...]) -> list[str]:
    """Those of ``keys`` that have more than one value among ``runs``."""
    return [k for k in keys if len({_setting(run, k) for run in runs}) > 1]


def setting_differences(runs: list[Run]) -> list[str]:
    """Report lines on what differs between runs shown side by side: a warning when their data,
    vocabulary or sequence length differ (their perplexities are not comparable), then each
    generic training setting with more than one value, e.g. ``optim.lr 0.005 (a), 0.015 (b)``.
    Empty when they all match."""

    def differing(keys: tuple[str, ...]) -> list[str]:
        out = []
        for key in _differing_keys(runs, keys):
            by_value: dict[str, list[str]] = {}
            for run in runs:
                by_value.setdefault(_setting(run, key), []).append(run.name)
            out.append(f"`{key}` " + ", ".join(f"{v} ({', '.join(n)})"
                                               for v, n in by_value.items()))  # fmt: skip
        return out

    lines = []
    if data := differing(DATA_KEYS):
        lines.append("**Not comparable:** these runs differ in data, vocabulary or sequence "
                     "length, so their perplexities measure different things: "
                     + "; ".join(data) + ".")  # fmt: skip
    if settings := differing(SETTING_KEYS):
        lines.append("Settings that differ: " + "; ".join(settings) + ".")
    return lines


def curve_legend(model: str, runs: list[Run]) -> tuple[str, list[str]]:
    """The title of one model's loss / perplexity panel and a legend label per run (in the
    order given). Runs on different data, vocabulary or sequence length (:data:`DATA_KEYS`)
    drawn on one panel say so: the title names the keys and each label the run's values."""
    keys = _differing_keys(runs, DATA_KEYS)
    labels = [f"{run.method} ({run.name})" for run in runs]
    if not keys:
        return model, labels
    labels = [
        f"{run.method} ({run.name}; " + ", ".join(f"{k} {_setting(run, k)}" for k in keys) + ")"
        for run in runs
    ]
    return f"{model}: different {', '.join(keys)}, not comparable", labels


def plot_notes(runs: list[Run]) -> list[str]:
    """One line per model whose runs, drawn on one loss / perplexity panel, differ in data,
    vocabulary or sequence length (:data:`DATA_KEYS`); empty when none do."""
    notes = []
    for model in sorted({r.model for r in runs}):
        keys = _differing_keys([r for r in runs if r.model == model], DATA_KEYS)
        if keys:
            notes.append(
                f"the loss and perplexity plots of {model} draw runs that differ in "
                f"{', '.join(keys)} on one panel: their curves are not comparable (the legend "
                "names each run's values)"
            )
    return notes


def results_rows(runs: list[Run]) -> list[dict[str, str]]:
    """One table row (strings) per run, in report order."""
    rows = []
    for run in sorted(runs, key=_order):
        s = run.summary
        mem, kind = run.peak_memory
        name = f"{run.name} — {run.stopped}" if run.stopped else run.name
        if s.get("resumed_from"):  # tokens/s and wall time cover every session
            name += f" (resumed at step {', '.join(map(str, s['resumed_from']))})"
        rows.append({
            "model": run.model, "run": name, "method": run.method, "bits": run.bits,
            "final val ppl": _final_ppl(run),
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


def _plots(runs: list[Run], out: Path) -> list[str]:
    """Draw the plots into ``out``; returns the names drawn, in :data:`PLOTS` order (a bar chart
    with no value for any run is left out, and an older file of its name removed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(runs, key=_order)
    models = sorted({r.model for r in runs})

    def curves(key: str, fname: str, ylabel: str, logy: bool) -> None:
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
        for ax, model in zip(axes[0], models):
            panel = [r for r in runs if r.model == model]
            title, labels = curve_legend(model, panel)
            for run, label in zip(panel, labels, strict=True):
                tps = run.summary.get("tokens", 0) / max(run.summary.get("steps", 1), 1)
                pts = [(m["step"] * tps, m[key]) for m in run.metrics if m.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o" if len(pts) < 20 else None, ms=3,
                            label=label)  # fmt: skip
            ax.set_title(title, **({"fontsize": 9} if title != model else {}))
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

    drawn = ["loss.png", "val_ppl.png"]

    def bars(values: list[float | None], fname: str, ylabel: str) -> None:
        if all(v is None for v in values):  # nothing to show: no empty chart
            (out / fname).unlink(missing_ok=True)
            return
        drawn.append(fname)
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
    return drawn


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


def build_report(
    run_dirs: list[str | Path], out_dir: str | Path, echo: Callable[[str], None] | None = None
) -> Path:
    """Read ``run_dirs`` and write ``report.md`` and the PNG plots into ``out_dir``; ``echo``
    (e.g. ``print``) gets a ``note:`` line for each model whose plotted runs differ in data,
    vocabulary or sequence length (:func:`plot_notes`).

    Returns:
        The path of ``report.md``.

    Raises:
        ReportError: no run given, a run directory is missing/unreadable, or ``out_dir`` is
            empty, a file, a run directory or inside one (nothing is written).
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
    if not str(out_dir).strip():
        raise ReportError(
            f"-o is empty; name a folder for the report (default {DEFAULT_REPORT_DIR}/)"
        )
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ReportError(f"'{out}' exists and is not a directory; choose another -o")
    if (out / "recipe.yaml").is_file() or (out / "checkpoints").is_dir():
        raise ReportError(f"'{out}' is a run directory; write the report elsewhere (-o DIR)")
    for parent in out.resolve().parents:  # a report inside a run would mix with its files
        if (parent / "recipe.yaml").is_file() and (parent / "metrics.jsonl").is_file():
            raise ReportError(
                f"'{out}' lies inside the run directory '{parent}'; write the report elsewhere "
                "(-o DIR)"
            )
    if (why := unwritable_reason(out)) is not None:
        raise ReportError(f"cannot write '{out}': {why}; choose another -o")
    out.mkdir(parents=True, exist_ok=True)
    drawn = _plots(runs, out)
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
        for note in setting_differences([r for r in runs if r.model == model]):
            lines += ["", note]
    lines += ["", "## Plots", ""]
    for note in plot_notes(runs):
        lines += [f"**Note:** {note}.", ""]
        if echo is not None:
            echo(f"note: {note}")
    titles = {"loss.png": "Training loss", "val_ppl.png": "Validation perplexity",
              "throughput.png": "Throughput", "peak_memory.png": "Peak memory"}  # fmt: skip
    for name in drawn:
        lines += [f"![{titles[name]}]({name})", ""]
    if _has_diagnostics(runs):  # _plots drew diagnostics.png
        lines += ["![Diagnostics (train.diagnostics_every)](diagnostics.png)", ""]
    lines += ["## Runs", ""]
    for run in sorted(runs, key=_order):
        s = run.summary
        ppl0, ppl = _fmt_number(s.get("initial_val_ppl")), _final_ppl(run)
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
           "build_report", "read_run", "results_rows"]  # fmt: skip
