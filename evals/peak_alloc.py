"""What is alive at the allocator's peak: a replay of PyTorch's CUDA allocator trace.

``torch.cuda.memory._record_memory_history(stacks="python")`` records every allocation and free
of the caching allocator with the Python frames that made it; ``torch.cuda.memory._snapshot()``
returns them as ``device_traces``. :func:`live_at_peak` replays one device's events, finds the
moment the bytes allocated *since recording began* were highest, and returns the blocks alive
then. :func:`group_by_site` sums them by the innermost frame in this project's code (or, when
none is ours, the innermost frame at all), which says which line of ours holds the memory.

Used by ``evals/gpu_memory.py --peak-report PATH``; a test replays a hand-written trace.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

#: path parts that mark a frame as this project's code
OURS = ("poetxq/", "quant_kernels/", "evals/")


def live_at_peak(events: Sequence[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """Replay ``events`` (one device's trace: dicts with ``action``, ``addr``, ``size`` and
    optionally ``frames``) and return ``(peak_bytes, blocks alive at the peak)``.

    ``alloc`` adds a block, ``free_completed`` removes it (its memory is reusable only then);
    other actions (``free_requested``, segment and snapshot events) are ignored. Bytes allocated
    before recording began are not counted, so ``peak_bytes`` is the transient peak on top of
    them. Blocks freed that were never seen allocated are skipped. The returned blocks are the
    alloc events themselves, largest first.
    """
    live: dict[int, dict[str, Any]] = {}
    cur = peak = 0
    peak_at = -1
    for i, ev in enumerate(events):
        act = ev.get("action")
        if act == "alloc":
            live[ev["addr"]] = ev
            cur += int(ev["size"])
            if cur > peak:
                peak, peak_at = cur, i
        elif act == "free_completed" and ev["addr"] in live:
            cur -= int(live.pop(ev["addr"])["size"])
    live = {}
    for ev in events[: peak_at + 1]:  # second pass: the live set at the peak
        act = ev.get("action")
        if act == "alloc":
            live[ev["addr"]] = ev
        elif act == "free_completed":
            live.pop(ev["addr"], None)
    return peak, sorted(live.values(), key=lambda e: -int(e["size"]))


def site(frames: Iterable[dict[str, Any]]) -> str:
    """``file:line name`` of the innermost frame in this project's code (:data:`OURS`), else of
    the innermost frame; ``"?"`` when there are none."""
    frames = list(frames)
    for f in frames:  # innermost first, as the allocator records them
        name = str(f.get("filename", ""))
        if any(part in name for part in OURS):
            short = name[max(name.find(p) for p in OURS if p in name) :]
            return f"{short}:{f.get('line')} {f.get('name')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename')}:{f.get('line')} {f.get('name')}"
    return "?"


def group_by_site(blocks: Iterable[dict[str, Any]], top: int = 30) -> list[dict[str, Any]]:
    """Sum ``blocks`` (alloc events) by :func:`site` (blocks without frames by their size):
    ``[{"site", "bytes", "count", "largest"}]``, most bytes first, at most ``top`` rows."""
    rows: dict[str, dict[str, Any]] = {}
    for b in blocks:
        frames = b.get("frames") or ()  # none when recorded without stacks: group by size
        key = site(frames) if frames else f"? ({int(b['size'])} bytes)"
        row = rows.setdefault(key, {"site": key, "bytes": 0, "count": 0, "largest": 0})
        size = int(b["size"])
        row["bytes"] += size
        row["count"] += 1
        row["largest"] = max(row["largest"], size)
    return sorted(rows.values(), key=lambda r: -r["bytes"])[:top]


def peak_report(snapshot: dict[str, Any], device: int = 0, top: int = 30) -> dict[str, Any]:
    """From ``torch.cuda.memory._snapshot()``: the transient peak (bytes above what was
    allocated when recording began) and the live blocks grouped by site."""
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    peak, blocks = live_at_peak(events)
    return {"events": len(events), "peak_bytes": peak, "live_blocks": len(blocks),
            "by_site": group_by_site(blocks, top)}  # fmt: skip


def fragmentation(segments: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Where reserved bytes sit, from ``torch.cuda.memory_snapshot()`` (a list of segments with
    ``total_size``, ``allocated_size``, ``segment_pool_id`` and ``blocks``): per pool (the
    default one is ``"default"``, a CUDA graph's private pool its id), the segments, their
    reserved and allocated bytes, the free bytes in segments that also hold live blocks (what
    ``torch.cuda.empty_cache`` cannot hand back), the largest such free block, and the bytes
    the live blocks hold beyond what was asked for (``requested``: a block keeps a remainder
    too small to split, below 1 MiB in the large pool)."""
    pools: dict[str, dict[str, Any]] = {}
    for seg in segments:
        pid = tuple(seg.get("segment_pool_id") or (0, 0))
        key = "default" if pid == (0, 0) else f"{pid[0]},{pid[1]}"
        empty = dict.fromkeys(
            ("segments", "reserved", "allocated", "requested", "free_in_used_segments",
             "largest_free_block"), 0,
        )  # fmt: skip
        row = pools.setdefault(key, empty)
        total, used = int(seg["total_size"]), int(seg["allocated_size"])
        row["segments"] += 1
        row["reserved"] += total
        row["allocated"] += used
        for b in seg.get("blocks", ()):
            if b.get("state") == "active_allocated":
                row["requested"] += int(b.get("requested_size", b["size"]))
        if used:
            row["free_in_used_segments"] += total - used
            free = [int(b["size"]) for b in seg.get("blocks", ()) if b.get("state") == "inactive"]
            row["largest_free_block"] = max([row["largest_free_block"], *free])
    return pools
