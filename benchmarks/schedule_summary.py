"""Combine swept GPU evaluations (benchmarks/eval_gpu.py --sweep-k) into one schedule-<hw>.json.

    python benchmarks/schedule_summary.py OUT/vllm/eval-vllm.json OUT/sglang/eval-sglang.json \\
        --out benchmarks/results/schedule-h200.json

Per engine and target: the derived schedule, min_speedup_scheduled (the schedule's lowest speedup over no
speculation across the concurrency points), min_ratio_to_best_fixed (its lowest throughput ratio to the best single
setting at each point), how it was verified, and every sweep point; all from the one run each file records.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEPT = ("engine_version", "hardware", "target", "k", "ks", "num_prompts", "max_new_tokens", "extra_args", "parity",
        "schedule", "schedule_description", "schedule_supported", "schedule_support_note", "verification",
        "why_sweep", "min_speedup_scheduled", "min_ratio_to_best_fixed", "comparisons", "rejected", "sweep",
        "commands", "schedule_server_log", "seconds")


def summary_of(result: dict) -> dict:
    if "schedule" not in result:
        raise SystemExit(f"{result.get('engine')}: this evaluation has no schedule (run eval_gpu.py with --sweep-k)")
    out = {key: result.get(key) for key in KEPT}
    if out["verification"] == "sweep":
        out.update(compared_again(result))
    return out


def compared_again(result: dict) -> dict:
    """The comparisons of a schedule verified on the sweep's own servers, computed from the recorded sweep by this
    checkout's draftline.schedule (the same measurements; only the comparison's definition may have changed)."""
    from draftline.schedule import Schedule, SweepPoint, compare, derive_schedule, verification_from_sweep

    points = [SweepPoint.model_validate(p) for p in result["sweep"]]
    ranges = [tuple(r) for r in result["schedule"]]
    schedule = Schedule(engine=result["engine"], choices=derive_schedule(points, result["engine"]).choices,
                        ranges=ranges, repeats=min(len(p.runs) or 1 for p in points))
    schedule.verification = verification_from_sweep(schedule, points, result.get("why_sweep") or "")
    comparisons = compare(schedule, points)
    return {"comparisons": [c.model_dump(mode="json") for c in comparisons],
            "min_speedup_scheduled": min(c.speedup for c in comparisons),
            "min_ratio_to_best_fixed": min(c.ratio_to_best_fixed for c in comparisons)}


def table(runs: list[dict]) -> str:
    lines = ["| engine | target | schedule | min speedup scheduled | min ratio to best single setting | verified on |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        lines.append(f"| {r['engine']} {r['engine_version']} | {r['target_short']} | {r['schedule_description']} | "
                     f"{r['min_speedup_scheduled']:.3f} | {r['min_ratio_to_best_fixed']:.3f} | {r['verification']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="eval_gpu.py --sweep-k result files")
    p.add_argument("--out", required=True)
    p.add_argument("--command", default="", help="the command that produced the results, for the record")
    args = p.parse_args(argv)
    runs = []
    for path in args.results:
        result = json.loads(Path(path).read_text())
        if result.get("status") not in (None, "ok"):
            print(f"{path}: {result.get('engine')} {result['status']}: {result.get('reason')}", file=sys.stderr)
            continue
        run = {"engine": result["engine"], **summary_of(result)}
        run["target_short"] = run["target"].split(" inflated to ")[-1].split(" ")[0] if run["target"] else "?"
        runs.append(run)
    engines: dict[str, dict] = {}
    for r in runs:
        engines.setdefault(r["engine"], {})[r["target_short"]] = {
            key: r[key] for key in ("schedule", "schedule_description", "min_speedup_scheduled",
                                    "min_ratio_to_best_fixed", "verification")}
    out = {"benchmark": "schedule", "command": args.command, "hardware": runs[0]["hardware"] if runs else None,
           "engines": engines, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(table(runs))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
