"""trainer/memory_peak.py on a hand-built allocator snapshot: allocated and reserved replayed from the end state,
their peaks, the reserved-but-unused gap there, the live blocks at the allocated peak grouped by the code that
allocated them, and the reserve's growths by the allocation that did not fit."""

import pytest

from llm_training.trainer.memory_peak import GIB, allocation_site, format_peak_breakdown, peak_breakdown

OWN = [{"filename": "/usr/lib/python3/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
       {"filename": "/repo/llm_training/layers/moe.py", "line": 88, "name": "dispatch"}]  # fmt: skip
LOSS = [{"filename": "/repo/llm_training/trainer/losses.py", "line": 40, "name": "chunked_ce"}]
TORCH_ONLY = [{"filename": "/x/site-packages/torch/optim/adamw.py", "line": 7, "name": "step"}]


def _event(action, addr, gib, frames=()):
    return {"action": action, "addr": addr, "size": int(gib * GIB), "frames": list(frames), "stream": 0}


def _snapshot():
    """Before the recording: 10 GiB allocated (weights) in a 12 GiB segment. Recorded: a 4 GiB segment mapped,
    3 GiB of MoE activations and 2 GiB of logits allocated (peak 15 GiB allocated, 16 reserved), the logits freed,
    1 GiB of optimizer state allocated, then the MoE block freed: 11 GiB allocated, 16 reserved at the end."""
    events = [
        _event("segment_map", 1000, 4),
        _event("alloc", 1, 2, OWN),
        _event("alloc", 2, 1, OWN),
        _event("alloc", 3, 2, LOSS),
        _event("free_requested", 3, 2, LOSS),  # not yet free: the allocator frees it when this completes
        _event("free_completed", 3, 2, LOSS),
        _event("alloc", 4, 1, TORCH_ONLY),
        _event("free_completed", 1, 2, OWN),
        _event("free_completed", 2, 1, OWN),
    ]
    blocks = [{"size": int(10 * GIB), "state": "active_allocated"}, {"size": int(1 * GIB), "state": "active_allocated"},
              {"size": int(5 * GIB), "state": "inactive"}]  # fmt: skip
    return {"segments": [{"device": 0, "total_size": int(16 * GIB), "blocks": blocks},
                         {"device": 1, "total_size": int(99 * GIB), "blocks": []}],  # another GPU: not counted
            "device_traces": [events, []]}  # fmt: skip


def test_peaks_replayed_from_the_end_state():
    report = peak_breakdown(_snapshot())
    assert report["allocated_gib"] == pytest.approx({"start": 10, "peak": 15, "end": 11})
    assert report["reserved_gib"] == pytest.approx({"start": 12, "peak": 16, "end": 16})
    assert report["peak_event"]["allocated"] == 4  # after the 4th event (the logits), before their free
    assert report["unused_at_reserved_peak_gib"] == pytest.approx(16 - 10)  # the first state at 16 GiB reserved


def test_live_blocks_at_the_allocated_peak_by_site():
    sites = {s["site"]: (s["gib"], s["blocks"]) for s in peak_breakdown(_snapshot())["at_allocated_peak"]}
    assert sites == {
        "(allocated before the recording)": (pytest.approx(10), None),
        "/repo/llm_training/layers/moe.py:88 dispatch": (pytest.approx(3), 2),  # our frame, not torch's linear
        "/repo/llm_training/trainer/losses.py:40 chunked_ce": (pytest.approx(2), 1),
    }
    text = format_peak_breakdown(peak_breakdown(_snapshot()))
    assert "allocated GiB start 10.00 peak 15.00 end 11.00" in text and "reserved GiB start 12.00 peak 16.00" in text
    assert "3.00 GiB in 2 blocks  /repo/llm_training/layers/moe.py:88 dispatch" in text


def test_sites_outside_our_code_and_without_a_stack():
    assert allocation_site(TORCH_ONLY) == "torch/optim/adamw.py:7 step"  # only torch frames: the innermost
    user = [*TORCH_ONLY, {"filename": "/home/me/train_helper.py", "line": 3, "name": "f"}]
    assert allocation_site(user) == "/home/me/train_helper.py:3 f"  # outside torch before torch itself
    assert allocation_site([]) == "(no stack recorded)"


def test_a_snapshot_without_history_reports_the_end_state():
    snap = _snapshot()
    snap["device_traces"] = []
    report = peak_breakdown(snap)
    assert report["events"] == 0 and report["allocated_gib"]["peak"] == pytest.approx(11)
    assert report["at_allocated_peak"][0]["gib"] == pytest.approx(11) and len(report["at_allocated_peak"]) == 1


def test_reserve_growth_by_the_allocation_that_did_not_fit():
    report = peak_breakdown(_snapshot())
    assert report["unused_at_allocated_peak_gib"] == pytest.approx(16 - 15)
    growth = report["reserve_growth"]
    assert growth["gib"] == pytest.approx(4) and growth["growths"] == 1
    assert growth["by_site"] == [  # the 4 GiB mapped for the first MoE block, while 12 - 10 = 2 GiB sat free
        {"site": "/repo/llm_training/layers/moe.py:88 dispatch", "gib": pytest.approx(4), "growths": 1,
         "request_gib": pytest.approx(2), "free_gib": pytest.approx(2)}
    ]  # fmt: skip
    text = format_peak_breakdown(report)
    assert "reserve grew by 4.00 GiB in 1 growths" in text
    assert "4.00 GiB in 1 growths  /repo/llm_training/layers/moe.py:88 dispatch  (request 2.00 GiB, free 2.00" in text


def test_fragmented_growths_and_one_at_the_end():
    """Two growths for the logits while 3 GiB were free in pieces, and one mapped after the last allocation."""
    snap = _snapshot()
    events = snap["device_traces"][0]
    events[3:3] = [_event("segment_map", 2000, 1), _event("segment_map", 3000, 1)]  # before the logits' alloc
    events.append(_event("segment_map", 4000, 1))
    snap["segments"][0]["total_size"] += int(3 * GIB)
    growth = peak_breakdown(snap)["reserve_growth"]
    assert growth["gib"] == pytest.approx(7) and growth["growths"] == 4
    by_site = {g["site"]: g for g in growth["by_site"]}
    logits = by_site["/repo/llm_training/trainer/losses.py:40 chunked_ce"]
    assert (logits["gib"], logits["growths"], logits["request_gib"]) == (pytest.approx(2), 2, pytest.approx(2))
    assert logits["free_gib"] == pytest.approx(16 - 13 + 1)  # 3 GiB free before the first map, 4 before the second
    assert by_site["(no allocation after it)"]["growths"] == 1
    assert growth["by_site"][0]["site"] == "/repo/llm_training/layers/moe.py:88 dispatch"  # most first
