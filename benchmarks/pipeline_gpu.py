"""The pipeline flow on a GPU machine, as a team runs it: `python -m flows.pipeline` on the 1.04B inflated demo target,
with Prefect's ephemeral API, every stage on the GPU; keeps the run's log, report and per-stage wall times.

    python benchmarks/pipeline_gpu.py --out /tmp/pipeline-h200          (needs vllm, prefect and draftline's deps)

Per-stage times come from the flow run's own log lines (each stage is a subflow: its "Beginning subflow run" and
"Finished in state" timestamps).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from extract_vllm import build_target  # noqa: E402  (benchmarks/extract_vllm.py)

FINISH = re.compile(r"^(\d\d:\d\d:\d\d\.\d+) \| INFO +\| Flow run '([^']+)' - Finished in state (\w+)")
BEGIN_NAME = re.compile(r"Beginning subflow run '([^']+)' for flow '([^']+)'")


def stage_times(log: str) -> dict[str, dict]:
    """{flow name: {"seconds", "state"}} for every subflow of the pipeline, from its log lines."""
    started, names, out = {}, {}, {}
    for line in log.splitlines():
        m = BEGIN_NAME.search(line)
        if m and (t := re.match(r"^(\d\d:\d\d:\d\d\.\d+)", line)):
            started[m.group(1)], names[m.group(1)] = t.group(1), m.group(2)
            continue
        f = FINISH.match(line)
        if f and f.group(2) in started:
            fmt = "%H:%M:%S.%f"
            span = (datetime.strptime(f.group(1), fmt) - datetime.strptime(started[f.group(2)], fmt)).total_seconds()
            out[names[f.group(2)]] = {"seconds": round(span % 86400, 1), "state": f.group(3)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "benchmarks" / "configs" / "pipeline-h200-1b.yaml"))
    ap.add_argument("--shape", default="1b", help="inflated demo shape (draftline.demo.inflate.SHAPES)")
    ap.add_argument("--work", default="/tmp/draftline-pipeline-gpu", help="target folder and store")
    ap.add_argument("--out", required=True, help="where the log, report, results and timings go")
    args = ap.parse_args(argv)

    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    target = build_target(work, args.shape)
    build_s = time.monotonic() - t0
    config = yaml.safe_load(Path(args.config).read_text())
    config["target"]["path"] = str(target)
    config["store"]["root"] = str(work / "runs")
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "PYTHONUNBUFFERED": "1"}
    t1 = time.monotonic()
    with open(out / "pipeline.log", "w") as log:
        code = subprocess.run([sys.executable, "-m", "flows.pipeline", "--config-json", json.dumps(config)],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    pipeline_s = time.monotonic() - t1
    text = (out / "pipeline.log").read_text(errors="replace")
    run_dir = work / "runs" / config["run"]
    engine_logs = [f"eval/{d.name}/logs" for d in sorted((run_dir / "eval").glob("*")) if (d / "logs").is_dir()]
    for rel in ("eval/report", *engine_logs, "eval/reference/result.json", "traces/stats.json",
                "train/metrics.json"):
        src = run_dir / rel
        if src.is_dir():
            shutil.copytree(src, out / rel.replace("/", "-"), dirs_exist_ok=True)
        elif src.is_file():
            shutil.copy(src, out / rel.replace("/", "-"))
    summary = {"returncode": code, "target_build_s": round(build_s, 1), "pipeline_s": round(pipeline_s, 1),
               "stages": stage_times(text), "config": config}
    import torch
    summary["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
