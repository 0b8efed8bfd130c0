"""Render ``docs/QUALITY.md`` (and its plots under ``docs/img/``) from quality-study results.

Called by ``python evals/quality.py report STUDY.yaml [STUDY.yaml ...]``; everything shown is
read from the studies' results JSON files, nothing is typed in by hand.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from evals.quality_plan import Study, plan_runs, run_id, shown, summarize
from evals.quality_stats import MIN_SEEDS

__all__ = ["parity_section", "render"]


def _lr_axes(study: Study, method: str) -> list[str]:
    spec = study.methods[method]
    return sorted(spec.grid, key=lambda k: -len(spec.grid[k]))


def _plot_lr(study: Study, results: dict, state: dict, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results.get("runs", {})
    fig, ax = plt.subplots(figsize=(7, 4.2))
    drawn = False
    diverged: list[float] = []
    for method in study.methods:
        axes = _lr_axes(study, method)
        x_key, other = axes[0], axes[1:]
        groups: dict[str, list[tuple[float, float]]] = {}
        for p in state.get(method, {}).get("points", []):
            vals = [runs[run_id(method, p, s)].get("tune_ppl") for s in study.tune_seeds
                    if run_id(method, p, s) in runs]  # fmt: skip
            if any(v is None for v in vals):
                diverged.append(p[x_key])
            vals = [v for v in vals if v is not None]
            if not vals:
                continue
            label = method + "".join(f", {k.split('.')[-1]}={p[k]:g}" for k in other)
            groups.setdefault(label, []).append((p[x_key], sum(vals) / len(vals)))
        for label, pts in groups.items():
            pts.sort()
            ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=label)
            drawn = True
    if not drawn:
        plt.close(fig)
        return False
    if diverged:  # drawn at the top edge: these runs have no perplexity
        top = ax.get_ylim()[1]
        ax.scatter(diverged, [top] * len(diverged), marker="x", color="k", label="diverged")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (the grid's first axis: optim.lr, or optim.poet_lr)")
    ax.set_ylabel("tune perplexity")
    ax.set_title(f"{study.name}: learning-rate sensitivity (mean over tuning seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_curves(study: Study, results: dict, summary: dict, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results.get("runs", {})
    fig, ax = plt.subplots(figsize=(7, 4.2))
    drawn = False
    for name, row in summary.items():
        if not row.get("tuned"):
            continue
        rid = run_id(name, row["best"], study.final_seeds[0])
        curve = [c for c in runs.get(rid, {}).get("val_curve", []) if c["step"] > 0]
        if curve:
            ax.plot([c["tokens"] / 1e6 for c in curve], [c["val_ppl"] for c in curve],
                    marker=".", label=name)  # fmt: skip
            drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.set_yscale("log")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("tune perplexity")
    ax.set_title(f"{study.name}: validation perplexity vs tokens (best setting, seed "
                 f"{study.final_seeds[0]})")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _diff_cell(row: dict[str, Any]) -> str:
    """``+0.73 (0.41 … 1.05), p 0.004`` from a row's paired statistics against the reference;
    the mean alone below two seeds, empty for the reference itself."""
    st = row.get("vs_reference_stats")
    if not st or not st["n"]:
        return ""
    if st["n"] < 2:
        return f"{st['mean']:+.2f} (1 seed)"
    low, high = st["ci"]
    p = st["p"]
    ps = "< 0.001" if p < 0.001 else f"{p:.3f}"
    return f"{st['mean']:+.2f} ({low:+.2f} … {high:+.2f}), p {ps}"


def _f(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return f"{v:,.{digits}f}" if isinstance(v, float) else str(v)


def _edge_notes(study: Study, state: dict[str, Any]) -> list[str]:
    """Tuned methods whose best point is the lowest or highest value tried on an axis of two or
    more values, e.g. ``poetxq: optim.lr 0.02 (high edge)``: the protocol's edge extension
    stopped there, so a better rate may lie outside."""
    notes = []
    for name, st in state.items():
        if name not in study.methods or not st.get("tuned") or not st.get("best"):
            continue
        for key, v in st["best"].items():
            tried = sorted({p[key] for p in st.get("points", [])})
            if len(tried) > 1 and v in (tried[0], tried[-1]):
                notes.append(f"{name}: {key} {v:g} ({'low' if v == tried[0] else 'high'} edge)")
    return notes


def _study_section(study: Study, results: dict, img_dir: Path, rel: str) -> list[str]:
    pending, state = plan_runs(study, json.loads(json.dumps(results)))
    summary = summarize(study, results)
    runs = results.get("runs", {})
    shape = {k.removeprefix("model."): v for k, v in study.shared.items() if k.startswith("model.")}
    reshaped = (" (reshaped by `shared`: " + ", ".join(f"{k} {v}" for k, v in shape.items()) + ")"
                if shape else "")  # fmt: skip
    out = [f"## {study.name}: {study.model}{reshaped}, {study.tokens / 1e6:g}M tokens per run", ""]
    calls = results.get("calls", [])
    if calls:
        last = calls[-1]
        out.append(
            f"Results file `{study.results}`; {len(runs)} runs finished, {len(pending)} pending;"
            f" last call {last['date']} on {last['device']} at {last['commit'][:7]}."
        )
        out.append("")
    if results.get("note"):  # how the calls went, session by session: folded away
        out += ["<details><summary>How the runs were made (the results file's note)</summary>",
                "", results["note"], "", "</details>", ""]  # fmt: skip
    corpus = results.get("corpus")
    if corpus:
        sp = corpus["splits"]
        out += [
            f"Corpus `{study.corpus}` (vocabulary {corpus['vocab_size']:,}): "
            + ", ".join(
                f"{k} {v['tokens'] / 1e6:.2f}M tokens / {v['documents']:,} documents"
                for k, v in sp.items()
            )
            + f"; {study.tokens / sp['train']['tokens']:.2f} epochs per run. Sources (documents "
            "per split): "
            + "; ".join(
                f"{s} {'/'.join(str(n) for n in c.values())}" for s, c in corpus["sources"].items()
            )
            + "."
            + (
                f" Test perplexities are on a subset of about {study.max_test_tokens:,} test "
                "tokens per run (`max_test_tokens`), not the whole split."
                if study.max_test_tokens is not None
                else ""
            ),
            "",
        ]
    out += ["| method | test ppl (mean ± sd) | seeds | − " + study.reference
            + " (95 % CI), p | " + study.reference + " is"
            + " | best setting (effective lr) | trials | steps | epochs | tok/s (no eval) "
            "| peak GiB | tune − train (nats) | ood ppl |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    host_rss = False  # a row shows a CPU run's host RSS instead of a CUDA peak
    for name, row in summary.items():
        like = study.controls[name].like if name in study.controls else name
        trials = len(state.get(like, {}).get("points", [])) * len(study.tune_seeds)
        if name in study.controls:
            trials = 0
        if not row.get("tuned"):
            mine = [r for r in runs.values() if r["method"] == name]
            # the tuning seeds' runs only, as the choice of the best point (a control's extra
            # seeds at one point would make the minimum a best-of-three)
            tuning = [r for r in mine if r.get("seed") in study.tune_seeds]
            scored = [r for r in tuning if r.get("tune_ppl") is not None]
            lead = min(scored, key=lambda r: r["tune_ppl"]) if scored else None
            so_far = (
                f"best tune ppl so far {lead['tune_ppl']:.2f} at "
                + ", ".join(f"{k} {v:g}" for k, v in lead["params"].items())
                if lead
                else "not started"
            )
            runs_so_far = f"tuning: {len(tuning)} point(s) run, {so_far}"
            out.append(f"| {name} | {runs_so_far} | | | | | {trials} | | | | | | |")
            continue
        recs = [runs[run_id(name, row["best"], s)] for s in [*study.final_seeds,
                *study.close_seeds] if run_id(name, row["best"], s) in runs]  # fmt: skip
        first = recs[0] if recs else {}
        eff = ", ".join(f"{k} {v:.3g}" for k, v in first.get("effective_lr", {}).items())

        def mean_of(key: str, recs: list[dict] = recs) -> float | None:
            vals = [r[key] for r in recs if r.get(key) is not None]
            return sum(vals) / len(vals) if vals else None

        ppl = f"{_f(row['mean'])} ± {_f(row['sd'])}" if row["test_ppl"] else ""
        if row.get("diverged"):
            ppl = "; ".join(x for x in (ppl, f"diverged ({len(row['diverged'])} seed(s))") if x)
        ppl = ppl or "not run yet"
        peak = _f(mean_of("peak_memory_gib"))
        if mean_of("peak_memory_gib") is None and (rss := mean_of("peak_rss_gib")) is not None:
            peak, host_rss = f"{_f(rss)} host RSS", True  # a CPU run: no CUDA peak
        out.append(
            f"| {name} | {ppl} | {len(recs)} | {_diff_cell(row)} | {row.get('vs_reference', '—')} "
            f"| {eff} | {trials} | {first.get('steps', '')} | {_f(first.get('epochs'))} "
            f"| {_f(mean_of('tokens_per_s'), 0)} "
            f"| {peak} | {_f(mean_of('train_tune_gap_nats'), 3)} | {_f(mean_of('ood_ppl'))} |"
        )
    out += ["", f"“− {study.reference}” is this row's test ppl minus {study.reference}'s, "
            "paired by seed: the mean, its 95 % Student-t interval and the paired t-test's "
            f"two-sided p. “{study.reference} is” reads: {study.reference} (the reference) is "
            "better / worse than this row's method when that interval excludes 0, tied when it "
            "contains 0 (no difference shown at this number of seeds), n/a with fewer than "
            f"{MIN_SEEDS} paired seeds. ood ppl: the corpus's out-of-distribution split (a "
            "source never trained on), mean over the seeds. tok/s is each run's own, "
            "measured while "
            "others shared the machine (the results file's note says how many): it compares runs, "
            "not methods' speed; `evals/results/throughput_*` do that."
            + (" Peak GiB is the CUDA allocator's peak; marked host RSS (a CPU run), the "
               "worker process's peak resident set size, Python, torch and the data included: "
               "not comparable with a GPU's number." if host_rss else ""), ""]  # fmt: skip
    if edges := _edge_notes(study, state):
        out += ["**Best point on the edge of what was tried** (the grid was not extended "
                f"further: `max_extend` {study.max_extend} reached): " + "; ".join(edges) + ".",
                ""]  # fmt: skip
    sources: list[str] = []
    for r in runs.values():
        sources += [s for s in r.get("test_ppl_by_source", {}) if s not in sources]
    if sources and any(row.get("tuned") for row in summary.values()):
        out += ["Test perplexity per source (best setting, mean over the final seeds):", "",
                "| method | " + " | ".join(sources) + " |",
                "|---|" + "---|" * len(sources)]  # fmt: skip
        for name, row in summary.items():
            if not row.get("tuned"):
                continue
            recs = [runs[run_id(name, row["best"], s)] for s in study.final_seeds
                    if run_id(name, row["best"], s) in runs]  # fmt: skip
            recs = [r for r in recs if r.get("test_ppl_by_source")]  # diverged: none
            if not recs:
                continue
            cells = [_f(sum(r["test_ppl_by_source"].get(s, math.nan) for r in recs) / len(recs))
                     for s in sources]  # fmt: skip
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("")
    tag = study.name.replace("/", "_")
    if _plot_lr(study, results, state, img_dir / f"quality_{tag}_lr.png"):
        out += [f"![lr sensitivity]({rel}/quality_{tag}_lr.png)", ""]
    if _plot_curves(study, results, summary, img_dir / f"quality_{tag}_curves.png"):
        out += [f"![validation curves]({rel}/quality_{tag}_curves.png)", ""]
    out += ["All tuning runs (tune-split perplexity, the number the learning rate is chosen by):",
            "", "| run | tune ppl | test ppl | tok/s |", "|---|---|---|---|"]  # fmt: skip
    for rid in sorted(runs):
        r = runs[rid]
        how = "diverged" if r.get("diverged") else _f(r.get("tune_ppl"), 3)
        out.append(
            f"| `{rid}` | {how} | {_f(r.get('test_ppl'), 3)} | {_f(r.get('tokens_per_s'), 0)} |"
        )
    return [*out, ""]


def parity_section(path: Path, img_dir: Path, rel: str) -> list[str]:
    """Markdown (and a plot) for one ``evals/parity_official.py`` results file: validation loss
    of our POET-XQ and the official code per evaluated step, mean over the seeds run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.loads(path.read_text())
    st, summ = d["settings"], d["summary"]
    code = d["official_code"]
    seeds = [r["seed"] for r in d["runs"] if r.get("ours") and r.get("official")]
    out = [
        f"## Parity with the official POET-XQ code ({st['model']}, {st['steps']} steps)", "",
        f"`{shown(path)}` ({d['gpu']}, commit "
        f"{d['commit'][:7]}, official code {code['repo']}@{code['commit'][:7]}): "
        f"{d['what']}. Settings: batch {st['batch_size']} x seq {st['seq_len']}, block size "
        f"{st['block_size']}, merge interval {st['merge_interval']}, poet_lr {st['poet_lr']:g}, "
        f"lr {st['lr']:g}, {st['precision']}; seeds run: {', '.join(map(str, seeds)) or 'none'}."
        " What cannot be made equal: " + "; ".join(d["differences"]) + ".", "",
        f"Rule: {summ['rule']}.", "",
        "| step | ours (val loss) | official | official − ours | by seed | agree |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    # each seed's own difference: the spread a mean's two-standard-error rule judges against
    by_seed: dict[int, list[str]] = {}
    for r in d["runs"]:
        ours = {v["step"]: v["val_loss"] for v in r.get("ours", {}).get("val", [])}
        theirs = {v["step"]: v["val_loss"] for v in r.get("official", {}).get("val", [])}
        for step in sorted(ours.keys() & theirs.keys()):
            by_seed.setdefault(step, []).append(f"{theirs[step] - ours[step]:+.4f}")
    for row in summ["steps"]:
        agree = {True: "yes", False: "**no**", None: "– (one seed)"}[row["agree"]]
        each = ", ".join(by_seed.get(row["step"], [])) or "–"
        out.append(f"| {row['step']} | {row['ours']:.4f} | {row['official']:.4f} "
                   f"| {row['difference']:+.4f} | {each} | {agree} |")  # fmt: skip
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for side, style in (("ours", "-"), ("official", "--")):
        for r in d["runs"]:
            pts = [v for v in r.get(side, {}).get("val", []) if v["step"] > 0]
            ax.plot([v["step"] for v in pts], [v["val_loss"] for v in pts], style, marker=".",
                    label=f"{side}, seed {r['seed']}")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats)")
    ax.set_title("POET-XQ: ours vs the official code")
    ax.legend(fontsize=7)
    fig.tight_layout()
    name = f"{path.stem}.png"
    fig.savefig(img_dir / name, dpi=110)
    plt.close(fig)
    return [*out, "", f"![parity curves]({rel}/{name})", ""]


def render(
    loaded: list[tuple[Study, dict[str, Any]]],
    out: Path,
    parity: list[Path] = (),
    *,
    command: str | None = None,
) -> None:
    """Write the Markdown report ``out`` and its plots (``out.parent / "img"``): one section per
    study, then one per ``evals/parity_official.py`` results file in ``parity``. ``command``:
    the command the header says rendered it (default: the studies' files under evals/studies/).
    """
    if command is None:
        command = "python evals/quality.py report " + " ".join(
            f"evals/studies/{s.name}.yaml" for s, _ in loaded
        )
    img = out.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Quality: POET-XQ against tuned baselines",
        "",
        f"Rendered by `{command}` from the results files named "
        "below; do not edit by hand. The protocol: every generic setting is the same "
        "for all methods (the study file's `shared`), each method keeps its authors' own knobs, "
        "every method gets the study's learning-rate grid, extended past any winning edge, "
        "chosen on the `tune` split; the final numbers are `test`-split perplexities at the "
        "chosen setting over the study's final seeds, compared with the reference by paired "
        "95 % t-intervals. The first-protocol studies (issue 32: `llama60m_50m`, "
        "`llama60m_150m`) trained every baseline's embeddings, lm_head and norms at its matrix "
        "learning rate (a 1-D grid; AdamW's capped at 2e-3 by its unstable matrices), shared "
        "betas (0.9, 0.999) without weight decay, split the corpus by ~8k-character chunk (pages "
        "of one file in train and test) and reused the tuning seed as a final seed; "
        "`llama60m_50m_v2` (issue 51) fixes each: betas (0.9, 0.95), weight decay 0.1, a 2-D "
        "grid of embedding lr x matrix knob for every method, a split by whole file, final seeds "
        "apart from the tuning seed, and an out-of-distribution split.",
        "",
    ]  # fmt: skip
    for study, results in loaded:
        shared = ", ".join(f"`{k}={v}`" for k, v in study.shared.items())
        lines += [f"Shared settings of `{study.name}`: {shared}; warmup "
                  f"{study.warmup_fraction:.0%} of the steps.", ""]  # fmt: skip
        lines += _study_section(study, results, img, "img")
    for path in parity:
        lines += parity_section(path, img, "img")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
