"""What holds GPU memory at its peak, read from a CUDA allocator snapshot recorded with history
(`torch.cuda.memory._record_memory_history()` ... `torch.cuda.memory._snapshot()`, the dict `_dump_snapshot` pickles).

    report = peak_breakdown(snapshot)        # allocated and reserved over the recording, and what was live
    print(format_peak_breakdown(report))     # at the allocated peak, grouped by the code that allocated it

The snapshot holds the allocator's segments at the end and, per device, a trace of the recorded events (alloc,
free_completed; segment_alloc / segment_free and, with expandable segments, segment_map / segment_unmap). Replaying
the trace gives allocated and reserved bytes after every event, anchored at the end state; memory allocated before
the recording started (or by events that fell out of the history buffer) shows as "before the recording". A block
counts as allocated until its free completes (a block freed on one stream while another still uses it stays
allocated until then, as in the allocator).
The peak's live blocks are grouped by their allocation site: the innermost frame in this project's code
(`llm_training/`, `optimizer/`, `activation`), else the innermost frame outside torch's own files, else the
innermost frame. The gap between reserved and allocated at the reserved peak is what the caching allocator holds
unused there: fragmentation and blocks cached for sizes nobody asks for; the gap at the allocated peak is what it
holds unused at the moment of highest demand.

Each time the reserve grows (a segment allocated or, with expandable segments, mapped) the allocation that follows
is the request no cached free block could hold; the growths are summed by that request's site, with the largest
request and the free (reserved, unallocated) memory the pool held just before it grew: much free memory at a
growth means the free memory was in pieces smaller than the request (fragmentation).
"""

from __future__ import annotations

from collections import defaultdict

GIB = 2**30
_OWN_CODE = ("llm_training/", "optimizer/", "activation")
_RESERVE = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_ALLOCATE = {"alloc": 1, "free_completed": -1}


def allocation_site(frames: list[dict]) -> str:
    """The frame that best names who allocated a block, as "file:line function" (module docstring)."""
    if not frames:
        return "(no stack recorded)"

    def pick(frame: dict) -> str:
        name = frame.get("filename", "?")
        short = name.split("site-packages/")[-1]
        return f"{short}:{frame.get('line', '?')} {frame.get('name', '?')}"

    for frame in frames:
        if any(part in frame.get("filename", "") for part in _OWN_CODE):
            return pick(frame)
    for frame in frames:
        name = frame.get("filename", "")
        if "/torch/" not in name and not name.startswith("<") and name.endswith(".py"):
            return pick(frame)
    return pick(frames[0])


def peak_breakdown(snapshot: dict, device: int = 0, top: int = 12) -> dict:
    """Allocated and reserved GiB at the start, peak and end of the recording on `device`, the gap between them at
    the reserved and at the allocated peak, the `top` allocation sites live at the allocated peak, and the reserve's
    growths by the `top` sites of the allocations that did not fit (module docstring)."""
    segments = [s for s in snapshot.get("segments", []) if s.get("device", 0) == device]
    end_reserved = sum(s["total_size"] for s in segments)
    end_allocated = sum(b["size"] for s in segments for b in s.get("blocks", []) if b["state"] == "active_allocated")
    traces = snapshot.get("device_traces", [])
    events = traces[device] if device < len(traces) else []
    d_alloc = [_ALLOCATE.get(e["action"], 0) * e["size"] for e in events]
    d_resv = [_RESERVE.get(e["action"], 0) * e["size"] for e in events]
    allocated = [end_allocated - sum(d_alloc)]
    reserved = [end_reserved - sum(d_resv)]
    for a, r in zip(d_alloc, d_resv):
        allocated.append(allocated[-1] + a)
        reserved.append(reserved[-1] + r)
    peak_a = max(range(len(allocated)), key=allocated.__getitem__)  # index into the states (0: before any event)
    peak_r = max(range(len(reserved)), key=reserved.__getitem__)
    live: dict[int, tuple[int, str]] = {}  # addr -> (size, site) of the blocks allocated during the recording
    for e in events[:peak_a]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], allocation_site(e.get("frames", [])))
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    growth = _reserve_growth(events, allocated, reserved, top)
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in live.values():
        by_site[site][0] += size
        by_site[site][1] += 1
    recorded = sum(size for size, _ in live.values())
    sites = sorted(by_site.items(), key=lambda kv: -kv[1][0])
    return {
        "events": len(events),
        "allocated_gib": {k: allocated[i] / GIB for k, i in (("start", 0), ("peak", peak_a), ("end", -1))},
        "reserved_gib": {k: reserved[i] / GIB for k, i in (("start", 0), ("peak", peak_r), ("end", -1))},
        "peak_event": {"allocated": peak_a, "reserved": peak_r},
        "unused_at_reserved_peak_gib": (reserved[peak_r] - allocated[peak_r]) / GIB,
        "unused_at_allocated_peak_gib": (reserved[peak_a] - allocated[peak_a]) / GIB,
        "reserve_growth": growth,
        "at_allocated_peak": [
            {"site": "(allocated before the recording)", "gib": (allocated[peak_a] - recorded) / GIB, "blocks": None},
            *({"site": site, "gib": size / GIB, "blocks": n} for site, (size, n) in sites[:top]),
        ],
        "other_sites_gib": sum(size for _, (size, _) in sites[top:]) / GIB,
    }


def _reserve_growth(events: list[dict], allocated: list[int], reserved: list[int], top: int) -> dict:
    """The reserve's growths during the recording, summed by the site of the allocation that followed each one
    (module docstring). `allocated` / `reserved` are the replayed states (index i: before event i)."""
    by_site: dict[str, dict] = {}
    pending: list[tuple[int, int]] = []  # (bytes grown, free bytes just before) waiting for their allocation
    total = count = 0
    for i, e in enumerate(events):
        if _RESERVE.get(e["action"], 0) > 0:
            pending.append((e["size"], reserved[i] - allocated[i]))
            total, count = total + e["size"], count + 1
        elif e["action"] == "alloc" and pending:
            site = by_site.setdefault(
                allocation_site(e.get("frames", [])), {"gib": 0.0, "growths": 0, "request_gib": 0.0, "free_gib": 0.0}
            )
            for grown, free in pending:
                site["gib"] += grown / GIB
                site["growths"] += 1
                site["free_gib"] = max(site["free_gib"], free / GIB)
            site["request_gib"] = max(site["request_gib"], e["size"] / GIB)
            pending = []
    if pending:  # grown at the very end of the recording, no allocation after it
        by_site["(no allocation after it)"] = {
            "gib": sum(g for g, _ in pending) / GIB, "growths": len(pending), "request_gib": 0.0,
            "free_gib": max(f for _, f in pending) / GIB,
        }  # fmt: skip
    sites = sorted(({"site": k, **v} for k, v in by_site.items()), key=lambda s: -s["gib"])
    return {"gib": total / GIB, "growths": count, "by_site": sites[:top]}


def format_peak_breakdown(report: dict) -> str:
    """The report as a few lines of text."""
    a, r = report["allocated_gib"], report["reserved_gib"]
    head = (
        f"allocated GiB start {a['start']:.2f} peak {a['peak']:.2f} end {a['end']:.2f}; reserved GiB start "
        f"{r['start']:.2f} peak {r['peak']:.2f} end {r['end']:.2f}; reserved but unused at the reserved peak "
        f"{report['unused_at_reserved_peak_gib']:.2f} GiB, at the allocated peak "
        f"{report['unused_at_allocated_peak_gib']:.2f} GiB ({report['events']} events recorded)"
    )
    lines = [head, "live at the allocated peak, by allocation site:"]
    for s in report["at_allocated_peak"]:
        blocks = "" if s["blocks"] is None else f" in {s['blocks']} blocks"
        lines.append(f"  {s['gib']:8.2f} GiB{blocks}  {s['site']}")
    if report["other_sites_gib"]:
        lines.append(f"  {report['other_sites_gib']:8.2f} GiB  (other sites)")
    growth = report["reserve_growth"]
    if growth["growths"]:
        lines.append(
            f"reserve grew by {growth['gib']:.2f} GiB in {growth['growths']} growths; by the allocation that did not "
            "fit (its largest request; the most free memory the pool held when it grew):"
        )
        for g in growth["by_site"]:
            lines.append(
                f"  {g['gib']:8.2f} GiB in {g['growths']} growths  {g['site']}  (request {g['request_gib']:.2f} GiB, "
                f"free {g['free_gib']:.2f} GiB)"
            )
    return "\n".join(lines)
