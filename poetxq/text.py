"""Small helpers for the lines poetxq prints."""

from __future__ import annotations


def count(n: object, noun: str) -> str:
    """``"1 step"``, ``"3 steps"``, ``"n/a steps"``: ``n`` and ``noun``, plural unless ``n == 1``
    (``noun`` takes a plain ``s``)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
