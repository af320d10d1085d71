"""The planner on the CPU with and without `--calibrate`, against the demo's stages run right after it on this machine:
idle, with one core kept busy by another process, and with every core kept busy (as on a shared machine).

    .venv/bin/python benchmarks/plan_calibrated.py [--steps 60] [--out benchmarks/results/plan-calibrated-cpu.json]
    .venv/bin/python benchmarks/plan_calibrated.py --probe-only   # the probe's reference reading, on an idle machine

Per condition: draftline.plan_probe's reading (what `draftline plan --calibrate` runs), then configs/demo.yaml's
traces, extraction and training (--steps steps) in a fresh store, each stage timed; then the plan for the measured
workload (traces, mean prompt and answer tokens) without and with the calibration, per stage against the measured
wall time. benchmarks/plan_check.py takes the rows into plan-check.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftline import stages  # noqa: E402
from draftline.config import PipelineConfig  # noqa: E402
from draftline.config_loading import load_config, merge_overrides, parse_config  # noqa: E402
from draftline.plan import build_plan  # noqa: E402
from draftline.plan_model import calibration  # noqa: E402
from draftline.plan_probe import probe  # noqa: E402
from draftline.store import open_store  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from drafter_pair import cpu_name  # noqa: E402  (benchmarks/drafter_pair.py)

RESULTS = REPO / "benchmarks" / "results"
GOAL_LOG_RATIO = math.log(1.5)


def machine_name() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores"


class BusyCores:
    """`n` processes that each keep one core busy while the block runs."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self) -> "BusyCores":
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(1)
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def run_stages(config: PipelineConfig, failures: list) -> dict[str, float]:
    """Wall seconds of the traces, extraction and training stages, in a fresh run folder. A stage that fails is run
    once more, as the flows' retries would (it resumes what was written); its time is then both attempts'."""
    shutil.rmtree(Path(config.store.root) / config.run, ignore_errors=True)
    store = open_store(config.store.root)
    seconds = {}
    for name, stage in (("traces", stages.traces), ("extraction", stages.extract), ("training", stages.train)):
        t = time.perf_counter()
        try:
            stage(config, store)
        except Exception as exc:
            failures.append({"stage": name, "after_s": round(time.perf_counter() - t, 1),
                             "error": f"{type(exc).__name__}: {exc}"[:400]})
            print(f"  {name} failed ({failures[-1]['error']}); once more", flush=True)
            stage(config, store)
        seconds[name] = round(time.perf_counter() - t, 1)
        print(f"  {name}: {seconds[name]} s", flush=True)
    return seconds


def condition(name: str, busy: int, config: PipelineConfig) -> dict:
    with BusyCores(busy):
        machine = calibration()
        print(f"[{name}] {machine}", flush=True)
        failures: list = []
        measured = run_stages(config, failures)
    stats = stages.stored_trace_stats(config, open_store(config.store.root))
    workload = {"traces": stats["count"], "prompt_tokens": stats["prompt_tokens"] / stats["count"],
                "answer_tokens": stats["response_tokens"] / stats["count"]}
    return {"condition": name, "busy_processes": busy, "calibration": machine, "workload": workload,
            "rows": predicted_rows(config, machine, workload, measured), "failed_attempts": failures}


def predicted_rows(config: PipelineConfig, machine: dict, workload: dict, measured: dict[str, float]) -> list[dict]:
    """Each stage's measured time against the plan without and with the calibration."""
    plans = {kind: build_plan(config, hardware="cpu", machine=m, **workload)
             for kind, m in (("uncalibrated", None), ("calibrated", machine))}
    rows = []
    for stage, seconds in measured.items():
        row = {"stage": stage, "measured_s": seconds}
        for kind, plan in plans.items():
            predicted = next(s for s in plan["stages"] if s["stage"] == stage)["wall_s"]
            row[f"predicted_s_{kind}"] = round(predicted, 1)
            row[f"ratio_{kind}"] = round(predicted / seconds, 3)
        rows.append(row)
    return rows


def measured_conditions(config: PipelineConfig) -> list[dict]:
    cores = len(os.sched_getaffinity(0))
    conditions = []
    for name, busy in (("idle", 0), ("one core busy", 1), ("every core busy", cores)):
        try:
            conditions.append(condition(name, busy, config))
        except Exception as exc:  # a stage that failed under the load is a result too: recorded, not measured
            conditions.append({"condition": name, "busy_processes": busy, "rows": [],
                               "failed": f"{type(exc).__name__}: {exc}"[:400]})
            print(f"[{name}] failed: {conditions[-1]['failed']}", flush=True)
    return conditions


def replanned(config: PipelineConfig, conditions: list[dict]) -> list[dict]:
    """An earlier run's conditions, their recorded readings and workloads planned again against their measured times."""
    for c in conditions:
        if c["rows"]:
            c["rows"] = predicted_rows(config, c["calibration"], c["workload"],
                                       {r["stage"]: r["measured_s"] for r in c["rows"]})
    return conditions


def probe_only(out: Path) -> None:
    readings = [{k: v for k, v in probe().items() if k not in ("processes", "threaded")} for _ in range(5)]
    import torch

    result = {"what": "draftline.plan_probe's readings (a process per core with one torch thread each, then a torch "
                      "thread per core in one process), five on an idle machine", "hardware": machine_name(), "torch": torch.__version__,
              "date": date.today().isoformat(), "readings": readings,
              "tokens_per_cpu_s": round(statistics.median(r["tokens_per_cpu_s"] for r in readings), 1),
              "threaded_tokens_per_s": round(statistics.median(r["threaded_tokens_per_s"] for r in readings), 1),
              "command": ".venv/bin/python benchmarks/plan_calibrated.py --probe-only"}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(result)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="training steps of each run")
    ap.add_argument("--store", type=Path, default=REPO / "runs" / "plan-calibrated")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--probe-only", action="store_true", help="write the probe's reference reading and stop")
    ap.add_argument("--replan", type=Path, help="an earlier result file: plan its recorded readings and workloads "
                    "again with this code, against its measured times, running no stage")
    args = ap.parse_args()
    if args.probe_only:
        probe_only(args.out or RESULTS / "plan-probe-cpu.json")
        return 0
    os.chdir(REPO)  # the demo config's paths are relative to the repository root
    base = load_config(REPO / "configs" / "demo.yaml")
    config = parse_config(merge_overrides(base.model_dump(mode="json"), {
        "run": "plan-calibrated", "store": {"root": str(args.store)},
        "train": {"max_steps": args.steps, "val_every": args.steps, "checkpoint_every": args.steps}}),
        PipelineConfig, "plan calibration run")
    earlier = json.loads(args.replan.read_text()) if args.replan else None
    conditions = replanned(config, earlier["conditions"]) if earlier else measured_conditions(config)
    ratios = {kind: [r[f"ratio_{kind}"] for c in conditions for r in c["rows"]] for kind in ("uncalibrated", "calibrated")}
    result = {"hardware": earlier["hardware"] if earlier else machine_name(),
              "date": earlier["date"] if earlier else date.today().isoformat(), "config": "configs/demo.yaml",
              "steps": args.steps, "goal": {"max_abs_log_ratio": round(GOAL_LOG_RATIO, 3)},
              "max_abs_log_ratio_calibrated": round(max(abs(math.log(x)) for x in ratios["calibrated"]), 3),
              "max_abs_log_ratio_uncalibrated": round(max(abs(math.log(x)) for x in ratios["uncalibrated"]), 3),
              "conditions": conditions,
              "command": f".venv/bin/python benchmarks/plan_calibrated.py --steps {args.steps}",
              **({"replanned": "the predictions were made again from the recorded readings and workloads with the "
                               "planner's later code (benchmarks/plan_calibrated.py --replan)"} if earlier else {})}
    out = args.out or RESULTS / "plan-calibrated-cpu.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    for c in conditions:
        for r in c["rows"]:
            print(f"{c['condition']:<16} {r['stage']:<11} measured {r['measured_s']:>6.1f} s  uncalibrated "
                  f"{r['ratio_uncalibrated']:.2f}  calibrated {r['ratio_calibrated']:.2f}")
    print(f"max |log ratio|: calibrated {result['max_abs_log_ratio_calibrated']}, uncalibrated "
          f"{result['max_abs_log_ratio_uncalibrated']} (goal {GOAL_LOG_RATIO:.3f}); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
