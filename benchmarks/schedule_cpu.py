"""vLLM on this CPU without and with tcmalloc and Intel OpenMP preloaded: the demo's k sweep, schedule by load and
speedup, both ways in one run on one machine.

    make demo          # or the traces, extract, train and export stages of configs/demo.yaml
    python benchmarks/schedule_cpu.py [configs/demo.yaml] [--rounds 2] [--sweep-k 0 1 3] [--out OUT.json]

Each mode runs draftline's own engine evaluation (draftline.evaluate.evaluate_engine) of the config's vLLM entry on
its eval prompts: the sweep's servers, the schedule derived from them and, where it mixes k, its own server. "before"
starts vLLM with the worker's LD_PRELOAD as it is (preload_cpu_libraries: false), "after" as draftline now does.
Writes per engine `schedule`, `min_speedup_scheduled` and `min_ratio_to_best_fixed` (of the last round), and every
run's speedups, schedules and the engine's warnings about its libraries. No Prefect.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftline import schedule as schedule_lib  # noqa: E402
from draftline.config_loading import load_config  # noqa: E402
from draftline.engines.cpu_preload import cpu_preload  # noqa: E402
from draftline.evaluate import describe_hardware, evaluate_engine  # noqa: E402
from draftline.stages import stored_exports  # noqa: E402
from draftline.store import open_store  # noqa: E402

MODES = {"before": False, "after": True}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", default=str(ROOT / "configs" / "demo.yaml"),
                   help="a pipeline config whose run has a vLLM export (default configs/demo.yaml after `make demo`)")
    p.add_argument("--sweep-k", type=int, nargs="+", default=None, help="the k to serve, 0 among them (default: the "
                   "config's sweep_k, else 0 and its num_speculative_tokens)")
    p.add_argument("--repeats", type=int, default=None, help="measured runs per point (default: the config's)")
    p.add_argument("--store", default=None, help="the store holding the config's run (default: its store.root)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                   help="before (the worker's LD_PRELOAD as it is), after (draftline's preload), or both")
    p.add_argument("--rounds", type=int, default=1, help="the modes in turn this many times (the machine's load "
                   "drifts; the summary takes each mode's median speedup over its rounds)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "schedule-cpu.json"))
    return p.parse_args(argv)


def run_mode(mode: str, engine, config, drafter_dir: Path, store_root: Path) -> dict:
    cfg = engine.model_copy(update={"preload_cpu_libraries": MODES[mode]})
    started = time.monotonic()
    result = evaluate_engine(cfg, config.target.path, drafter_dir, config.eval.prompts, config.eval,
                             open_store(str(store_root / mode)), f"schedule-cpu-{mode}",
                             log_dir=store_root / f"{mode}-logs")
    s = result.schedule
    return {
        "preload_cpu_libraries": MODES[mode], "wall_s": round(time.monotonic() - started, 1),
        "engine_version": result.engine_version,
        "speedup": {str(p.concurrency): round(p.speedup, 3) for p in result.points},
        "speedup_range": {str(p.concurrency): [round(p.speedup_min or p.speedup, 3), round(p.speedup_max or p.speedup, 3)]
                          for p in result.points},
        "baseline_tok_s": {str(p.concurrency): round(p.baseline.output_tokens_per_s, 2) for p in result.points},
        "eagle3_tok_s": {str(p.concurrency): round(p.speculative.output_tokens_per_s, 2) for p in result.points},
        "acceptance_length": round(result.acceptance.mean_acceptance_length, 3) if result.acceptance else None,
        "schedule": [list(r) for r in s.ranges] if s else None,
        "schedule_description": s.describe() if s else None,
        "verification": s.verification.source if s and s.verification else None,
        "schedule_speedup": {str(c.concurrency): round(c.speedup, 3) for c in s.comparisons} if s else {},
        "min_speedup_scheduled": _round(schedule_lib.min_speedup(s)) if s else None,
        "min_ratio_to_best_fixed": _round(schedule_lib.min_ratio_to_best_fixed(s)) if s else None,
        "library_warnings": [w.text for w in result.engine_warnings
                             if "LD_PRELOAD" in w.text or "OpenMP" in w.text],
        "sweep": [p.model_dump() for p in result.sweep],
        "verification_points": [p.model_dump() for p in s.verification.points] if s and s.verification else [],
        "schedule_server_log": (result.server_log_facts.get("schedule") or {}).get("speculative_schedule"),
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def main(argv=None) -> int:
    args = parse_args(argv)
    config = load_config(args.config, overrides={"store": {"root": args.store}} if args.store else None)
    store = open_store(config.store.root)
    exports = stored_exports(config, store)
    if "vllm" not in exports:
        raise SystemExit(f"run {config.run!r} has no vllm export in {store.uri(config.run)}; run `make demo` first")
    drafter_dir = store.get_dir(exports["vllm"])
    engine = next(e for e in config.eval.engines if e.engine == "vllm")
    update = {}
    if args.sweep_k:
        update["sweep_k"] = args.sweep_k
    if args.repeats:
        update["repeats"] = args.repeats
    engine = type(engine).model_validate({**engine.model_dump(), **update})
    out: dict = {"machine": describe_hardware(), "config": args.config, "target": config.target.path,
                 "drafter": str(drafter_dir), "eval_prompts": config.eval.prompts, "ks": engine.ks,
                 "concurrency": engine.concurrency, "repeats": engine.repeats,
                 "preload_after": cpu_preload("")[0], "runs": {}}
    with tempfile.TemporaryDirectory(prefix="draftline-schedule-cpu-") as tmp:
        for round_ in range(args.rounds):
            for mode in args.modes:
                r = run_mode(mode, engine, config, drafter_dir, Path(tmp) / f"round{round_}")
                out["runs"].setdefault(mode, []).append(r)
                print(f"round {round_ + 1} {mode}: speedup {r['speedup']}, schedule {r['schedule_description']} "
                      f"{r['schedule_speedup']}, {r['wall_s']} s", flush=True)
    out["median_speedup"] = {mode: {c: statistics.median(r["speedup"][c] for r in runs) for c in runs[0]["speedup"]}
                             for mode, runs in out["runs"].items()}
    last = out["runs"][args.modes[-1]][-1]
    out["engines"] = {"vllm": {k: last[k] for k in ("schedule", "schedule_description", "min_speedup_scheduled",
                                                     "min_ratio_to_best_fixed")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'mode':8} {'round':>5} {'concurrency':>11} {'baseline tok/s':>15} {'EAGLE-3 tok/s':>14} {'speedup':>8} "
          f"{'schedule':>9}")
    for mode, runs in out["runs"].items():
        for i, r in enumerate(runs):
            for c in r["speedup"]:
                print(f"{mode:8} {i + 1:>5} {c:>11} {r['baseline_tok_s'][c]:>15.1f} {r['eagle3_tok_s'][c]:>14.1f} "
                      f"{r['speedup'][c]:>7.2f}x {r['schedule_speedup'].get(c, float('nan')):>8.2f}x")
    print(f"median speedup by mode: {out['median_speedup']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
