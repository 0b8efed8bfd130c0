"""Parity with the official POET-XQ, the summary rule: per evaluation step, both sides' mean
validation loss over the seeds, their difference and its standard error (:func:`summarize`).
The entry point is ``evals/parity_official.py``.
"""

from __future__ import annotations

import math
import statistics
from typing import Any


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per evaluation step: each side's mean validation loss over the seeds, their difference
    (official − ours) and, with two or more seeds, the standard error of that difference
    (seed noise); ``agree`` at a step when ``|difference| <= 2 · SE``. With one seed there is no
    noise estimate and ``agree`` is None."""
    done = [r for r in runs if "ours" in r and "official" in r]
    if not done:
        return {"seeds": 0, "steps": []}
    by_side: dict[str, dict[int, list[float]]] = {"ours": {}, "official": {}}
    diverged = {side: [r["seed"] for r in done if r[side].get("diverged")] for side in by_side}
    for r in done:
        for side in by_side:
            for p in r[side]["val"]:
                if p["val_loss"] is not None:
                    by_side[side].setdefault(p["step"], []).append(p["val_loss"])
    rows = []
    for step in sorted(set(by_side["ours"]) & set(by_side["official"])):
        a, b = by_side["ours"][step], by_side["official"][step]
        if not len(a) == len(b) == len(done):  # a seed diverged before this step
            continue
        row: dict[str, Any] = {"step": step, "ours": statistics.fmean(a),
                               "official": statistics.fmean(b)}  # fmt: skip
        row["difference"] = row["official"] - row["ours"]
        if len(a) >= 2:
            se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
            row["se"] = se
            row["agree"] = abs(row["difference"]) <= 2 * se
        else:
            row["se"], row["agree"] = None, None
        rows.append(row)
    final = rows[-1] if rows else None
    trained = [r for r in rows if r["step"] > 0]
    return {
        "seeds": len(done),
        "rule": "agree at a step: |mean official - mean ours| <= 2 x SE over seeds (>= 2 seeds); "
        "all_agree: at every evaluated step after step 0 (step 0 compares the two inits only)",
        "steps": rows,
        "final": final,
        "diverged_seeds": diverged,
        "all_agree": _all_agree(trained, diverged),
    }


def _all_agree(trained: list[dict[str, Any]], diverged: dict[str, list[int]]) -> bool | None:
    """False when a seed diverged on either side; None without a noise estimate (one seed);
    else whether every trained step agrees."""
    if any(diverged.values()):
        return False
    if not trained or trained[0]["agree"] is None:
        return None
    return all(r["agree"] for r in trained)
