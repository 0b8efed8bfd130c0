"""evals/peak_alloc.py: the live set at the allocator's peak, from a hand-written trace."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "evals") not in sys.path:
    sys.path.insert(0, str(REPO / "evals"))

from peak_alloc import fragmentation, group_by_site, live_at_peak, peak_report, site  # noqa: E402


def _f(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


OURS = [_f("/x/torch/nn/functional.py", 10, "linear"), _f("/r/poetxq/loss.py", 99, "backward")]
THEIRS = [_f("/x/torch/autograd/graph.py", 5, "run"), _f("/x/site/transformers/llama.py", 7, "f")]


def _trace() -> list[dict]:
    return [
        {"action": "alloc", "addr": 1, "size": 100, "frames": OURS},
        {"action": "alloc", "addr": 2, "size": 50, "frames": THEIRS},
        {"action": "free_requested", "addr": 1, "size": 100},  # not yet reusable: still counted
        {"action": "alloc", "addr": 3, "size": 30, "frames": OURS},  # peak: 100 + 50 + 30 = 180
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 99, "size": 7},  # allocated before recording
        {"action": "alloc", "addr": 4, "size": 120, "frames": THEIRS},  # 50 + 30 + 120 = 200
        {"action": "free_completed", "addr": 2, "size": 50},
        {"action": "segment_alloc", "addr": 500, "size": 4096},
    ]


def test_live_at_peak_replays_allocs_and_completed_frees():
    peak, blocks = live_at_peak(_trace())
    assert peak == 200
    assert [b["addr"] for b in blocks] == [4, 2, 3]  # largest first


def test_site_prefers_our_innermost_frame():
    assert site(OURS) == "poetxq/loss.py:99 backward"
    assert site(THEIRS) == "/x/torch/autograd/graph.py:5 run"
    assert site([]) == "?"


def test_group_by_site_and_report():
    _, blocks = live_at_peak(_trace())
    rows = group_by_site(blocks)
    assert rows == [
        {"site": "/x/torch/autograd/graph.py:5 run", "bytes": 170, "count": 2, "largest": 120},
        {"site": "poetxq/loss.py:99 backward", "bytes": 30, "count": 1, "largest": 30},
    ]
    rep = peak_report({"device_traces": [[], _trace()]}, device=1, top=1)
    assert rep["peak_bytes"] == 200 and rep["live_blocks"] == 3 and rep["events"] == 9
    assert [r["bytes"] for r in rep["by_site"]] == [170]
    assert peak_report({"device_traces": []})["peak_bytes"] == 0


def test_fragmentation_splits_pools_and_counts_free_bytes_beside_live_ones():
    def seg(total, blocks, pool=(0, 0)):
        used = sum(s for s, _, st in blocks if st == "active_allocated")
        return {"total_size": total, "allocated_size": used, "segment_pool_id": pool,
                "blocks": [{"size": s, "requested_size": r, "state": st}
                           for s, r, st in blocks]}  # fmt: skip

    segs = [
        seg(100, [(60, 52, "active_allocated"), (30, 0, "inactive"), (10, 0, "inactive")]),
        seg(50, [(50, 0, "inactive")]),  # wholly free: empty_cache hands it back
        seg(80, [(80, 80, "active_allocated")], pool=(1, 2)),
    ]
    got = fragmentation(segs)
    assert got["default"] == {"segments": 2, "reserved": 150, "allocated": 60, "requested": 52,
                              "free_in_used_segments": 40, "largest_free_block": 30}  # fmt: skip
    assert got["1,2"] == {"segments": 1, "reserved": 80, "allocated": 80, "requested": 80,
                          "free_in_used_segments": 0, "largest_free_block": 0}  # fmt: skip


def test_blocks_without_frames_group_by_size():
    blocks = [{"size": 64}, {"size": 64, "frames": []}, {"size": 32}]
    assert group_by_site(blocks) == [
        {"site": "? (64 bytes)", "bytes": 128, "count": 2, "largest": 64},
        {"site": "? (32 bytes)", "bytes": 32, "count": 1, "largest": 32},
    ]
