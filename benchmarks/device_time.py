"""Device time from profiler records: the union of kernel intervals (busy time), read from torch.profiler events or
from a Chrome trace that torch.profiler wrote (an engine server's, for one)."""
from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

# Chrome-trace categories of work on the device (torch.profiler's names).
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def union_length(intervals) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once: the time the device did anything."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def trace_kernels(path: str | Path) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every device event in a Chrome trace (.json or .json.gz), in start order."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)
    if isinstance(events, dict):
        events = events.get("traceEvents", [])
    out = [(e.get("name", "?"), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
           if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    return sorted(out, key=lambda k: k[1])


def device_summary(kernels: list[tuple[str, float, float]], steps: int, gap_ms: float = 20.0, top: int = 15) -> dict:
    """Busy and idle device time per step over the profiled window. Idle gaps longer than `gap_ms` (between
    requests, or before the first and after the last step) are left out of the active span, so that the per-step
    figures describe steps, not the client's pauses."""
    if not kernels or steps <= 0:
        return {"steps": steps, "kernels": len(kernels), "error": "no device events or no steps"}
    span = kernels[-1][2] - kernels[0][1]
    gaps, end = [], kernels[0][2]
    for _, a, b in kernels[1:]:
        if a - end > gap_ms * 1e3:
            gaps.append(a - end)
        end = max(end, b)
    busy = union_length((a, b) for _, a, b in kernels)
    active = span - sum(gaps)
    totals, counts = defaultdict(float), defaultdict(int)
    for name, a, b in kernels:
        totals[name] += b - a
        counts[name] += 1
    ms = 1e-3
    return {
        "steps": steps, "kernels": len(kernels), "span_ms": span * ms, "long_gaps": len(gaps),
        "long_gaps_ms": sum(gaps) * ms, "active_span_ms": active * ms, "busy_ms": busy * ms,
        "step_ms": active * ms / steps, "busy_per_step_ms": busy * ms / steps,
        "idle_per_step_ms": (active - busy) * ms / steps, "kernels_per_step": len(kernels) / steps,
        "top_kernels": [{"name": n, "ms_per_step": t * ms / steps, "calls_per_step": counts[n] / steps}
                        for n, t in sorted(totals.items(), key=lambda kv: -kv[1])[:top]],
    }
