"""How fast a GPU machine's host drives the GPU: the single-thread Python speed, the rate of small CUDA kernel
launches from eager torch, and draftline.plan_probe's CPU reading. A small target's decode step in vLLM is mostly
this host work (the scheduler, the sampler, the launches), so two GPU machines can decode a 1B target at different
speeds with the same GPU.

    python3 benchmarks/host_speed.py --out /tmp/host-speed.json      (needs torch; a GPU for the launch reading)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def python_ops_per_s(seconds: float = 2.0) -> float:
    """Iterations per second of a loop of dict, list and attribute work, the kind a scheduler does per request."""

    class Req:
        __slots__ = ("id", "tokens", "done")

        def __init__(self, i: int):
            self.id, self.tokens, self.done = i, [], False

    reqs = {i: Req(i) for i in range(64)}
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            r = reqs[n % 64]
            r.tokens.append(n)
            if len(r.tokens) > 128:
                r.tokens.clear()
                r.done = not r.done
            n += 1
    return n / seconds


def cuda_launches_per_s(seconds: float = 2.0) -> float | None:
    """Small eager kernels launched per second (each waits on nothing but the queue)."""
    import torch

    if not torch.cuda.is_available():
        return None
    x = torch.zeros(1024, device="cuda")
    for _ in range(100):
        x.add_(1.0)
    torch.cuda.synchronize()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(1000):
            x.add_(1.0)
        n += 1000
    torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON path")
    ap.add_argument("--label", default="", help="what the machine is (written into the JSON)")
    args = ap.parse_args()
    from draftline.plan_probe import probe

    import torch

    reading = probe()
    out = {"label": args.label, "cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)),
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "python": platform.python_version(), "torch": torch.__version__,
           "python_ops_per_s": round(python_ops_per_s()), "cuda_launches_per_s": cuda_launches_per_s(),
           "probe_tokens_per_cpu_s": round(reading["tokens_per_cpu_s"], 1), "probe_cpu_share": reading["cpu_share"],
           "probe_threaded_tokens_per_s": round(reading["threaded_tokens_per_s"], 1),
           "load_average_1m": os.getloadavg()[0]}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
