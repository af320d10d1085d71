"""benchmarks/device_time.py: device-busy time from a profiler's Chrome trace, which benchmarks/probes/sglang_profile.py
reads from SGLang's profiler and benchmarks/train.py's profile uses; a wrong union or gap rule would misstate where a
step's time goes."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from device_time import device_summary, trace_kernels, union_length  # noqa: E402


def test_overlapping_intervals_count_once():
    assert union_length([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert union_length([]) == 0


def _trace(tmp_path: Path, events: list[dict]) -> Path:
    path = tmp_path / "host.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path


def test_a_trace_gives_busy_and_idle_per_step_without_the_pauses_between_requests(tmp_path):
    us = 1000.0  # a millisecond in the trace's microseconds
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100 * us},  # host work: not device time
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 2 * us},
        {"ph": "X", "cat": "kernel", "name": "attention", "ts": 1 * us, "dur": 2 * us},  # overlaps gemm by 1 ms
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 4 * us, "dur": 1 * us},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 4 * us},  # an instant event has no duration
        # a 50 ms pause (the client between two requests), then the second step
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 55 * us, "dur": 2 * us},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 58 * us, "dur": 2 * us},
    ]
    kernels = trace_kernels(_trace(tmp_path, events))
    assert [k[0] for k in kernels] == ["gemm", "attention", "Memcpy DtoH", "gemm", "gemm"]
    s = device_summary(kernels, steps=2, gap_ms=20)
    assert s["span_ms"] == pytest.approx(60)
    assert s["long_gaps"] == 1 and s["long_gaps_ms"] == pytest.approx(50)
    assert s["active_span_ms"] == pytest.approx(10)
    assert s["busy_ms"] == pytest.approx(8)  # 3 (gemm and attention, overlapped) + 1 + 2 + 2
    assert s["step_ms"] == pytest.approx(5) and s["busy_per_step_ms"] == pytest.approx(4)
    assert s["idle_per_step_ms"] == pytest.approx(1)
    top = s["top_kernels"][0]
    assert top["name"] == "gemm" and top["ms_per_step"] == pytest.approx(3) and top["calls_per_step"] == 1.5


def test_an_empty_trace_says_so(tmp_path):
    s = device_summary(trace_kernels(_trace(tmp_path, [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}])),
                       steps=10)
    assert s["kernels"] == 0 and "no device events" in s["error"]
