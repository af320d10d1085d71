"""Where SGLang's EAGLE-3 iteration spends its time against its baseline step: device busy and idle per step, from
SGLang's own torch profiler (POST /start_profile), at concurrency 1, on the target and drafter of
benchmarks/decode.py --save.

    python3 benchmarks/probes/sglang_profile.py SAVED --out DIR [--speculative-args=WORDS ...]
        [--baseline-args=WORDS ...] [--extra-args ...]

Each --speculative-args (repeatable) is one EAGLE-3 server, each --baseline-args one more baseline server besides
the plain one, so one run compares settings such as the overlap scheduler on and off.
Per server (the plain baseline, the EAGLE-3 servers, the other baselines): start it as benchmarks/eval_gpu.py
does, warm it up with a few requests, profile --num-steps forward passes (kernels only by default) while sending
requests one at a time, and read the Chrome trace SGLang writes. Written to DIR: sglang-profile.json (after each
server), the traces and the server logs. Per server: steps, device busy and idle per step, the top kernels, and the
TPOT of the warm-up requests (unprofiled) and of those under the profiler; then an EAGLE-3 iteration in baseline
steps of device time. Reading it: if EAGLE-3's busy time per iteration is near (1 + k c) baseline steps but its
iteration (TPOT x acceptance length) is far above, host work binds; if its busy time is already far above, its
kernels do. A server that does not start is recorded with its error and the rest still run.

Reading the figures: the profiler adds host time to every step (on the H200 a baseline forward pass spanned 4.63 ms
under it against a TPOT of 4.27 ms without, an EAGLE-3 iteration 8.86 ms against about 6.3 ms), so busy time per
step is the profiled figure to trust and the unprofiled TPOT the step time; an EAGLE-3 iteration takes TPOT x
acceptance length. The TPOT of the profiled requests also holds the pause while SGLang writes its trace.

Needs a CUDA GPU and sglang (e.g. the offline site on PYTHONPATH, see benchmarks/eval_offline.sh); no Prefect.
Ran against SGLang 0.5.14 on an H200 (2026-12-01, benchmarks/log/2026-12-01-h200-engine-eval.md; /stop_profile
answers HTTP 500 there, as expected once num_steps has stopped the profiler). SGLang cannot run on the CI machines;
the trace reading is tested on CPU (tests/test_device_time.py).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from device_time import device_summary, trace_kernels  # noqa: E402  (benchmarks/device_time.py)
from draftline.engines.base import http_answer  # noqa: E402
from draftline.engines.client import load_prompts, run_load  # noqa: E402
from draftline.engines.launch import launch  # noqa: E402
from draftline.errors import EngineError  # noqa: E402
from draftline.engines.sglang import SglangAdapter  # noqa: E402
from eval_gpu import default_server_args, engine_config  # noqa: E402  (benchmarks/eval_gpu.py)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("saved", help="the folder benchmarks/decode.py --save wrote (target/, drafter/sglang)")
    p.add_argument("--out", required=True, help="folder for sglang-profile.json, the traces and the logs")
    p.add_argument("--prompts", default=str(ROOT / "assets" / "prompts" / "eval_prompts.jsonl"))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--num-steps", type=int, default=60, help="scheduler steps to profile per server")
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--requests", type=int, default=4, help="requests sent one at a time while profiling")
    p.add_argument("--activities", default="GPU",
                   help="SGLang profiler activities, comma-separated: GPU (kernels only, the least host overhead, "
                        "enough for busy against idle) or CPU,GPU (also the host's ops, slower under the profiler)")
    p.add_argument("--trace-wait-s", type=float, default=180.0, help="how long to wait for SGLang to write a trace")
    p.add_argument("--speculative-args", action="append", metavar="WORDS",
                   help="one EAGLE-3 server with these arguments (repeatable; default one server with none); give a "
                        "one-word value as --speculative-args=--flag and none as --speculative-args=")
    p.add_argument("--baseline-args", action="append", default=[], metavar="WORDS",
                   help="one more baseline server with these arguments (repeatable), after the plain baseline")
    p.add_argument("--extra-args", nargs=argparse.REMAINDER, default=None, help="to both servers (eval_gpu.py's)")
    return p.parse_args(argv)


def wait_for_trace(folder: Path, timeout_s: float, earlier: set[Path]) -> Path | None:
    """SGLang exports the trace after the last profiled step, asynchronously; wait until a file not in `earlier`
    (an earlier run's, when --out is reused) is complete."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = sorted(set(folder.glob("*.trace.json.gz")) - earlier)
        if found:
            size = found[0].stat().st_size
            time.sleep(2.0)
            if found[0].stat().st_size == size:
                return found[0]
        time.sleep(2.0)
    return None


def profile_server(mode: str, args, cfg, target_dir: Path, drafter_dir: Path | None, out: Path) -> dict:
    """One server's profile; cfg carries its arguments (for a baseline, speculative_extra_args go to it too)."""
    adapter = SglangAdapter()
    traces = out / f"trace-{mode}"
    traces.mkdir(parents=True, exist_ok=True)
    spec = adapter.server_spec(cfg, target_dir, drafter_dir, "target")
    spec.env = {**spec.env, "SGLANG_TORCH_PROFILER_DIR": str(traces)}
    prompts = load_prompts(args.prompts, args.warmup_requests + args.requests)
    requester = adapter.requester("target", target_dir, args.max_new_tokens, 0.0)
    with launch(spec, cfg, out / "logs" / mode) as server:
        earlier = set(traces.glob("*.trace.json.gz"))
        unprofiled, _ = run_load(server.base_url, prompts[:args.warmup_requests], 1, requester)
        # num_steps counts the scheduler's forward passes (an EAGLE-3 iteration is one), from now; SGLang stops the
        # profiler and writes the trace itself after them. Stacks and shapes off: they add host time to every op
        # (SGLang 0.5.14 records both unless told not to).
        started = http_answer("POST", server.base_url + "/start_profile",
                              json={"output_dir": str(traces), "num_steps": args.num_steps,
                                    "activities": args.activities.split(","), "with_stack": False,
                                    "record_shapes": False})
        if isinstance(started, dict) and "error" in started:
            return {"server": spec.name, "start_profile": started, "error": "SGLang refused /start_profile"}
        profiled, _ = run_load(server.base_url, prompts[args.warmup_requests:], 1, requester)
        stopped = http_answer("POST", server.base_url + "/stop_profile")  # refused when num_steps already ended it
        trace = wait_for_trace(traces, args.trace_wait_s, earlier)
    result = {"server": spec.name, "start_profile": started, "stop_profile": stopped,
              "tpot_ms": unprofiled.tpot_mean_s * 1e3, "tpot_ms_under_profiler": profiled.tpot_mean_s * 1e3,
              "output_tokens_per_s": unprofiled.output_tokens_per_s}
    if trace is None:
        return {**result, "error": f"no trace in {traces} within {args.trace_wait_s:.0f} s"}
    return {**result, "trace": str(trace), **device_summary(trace_kernels(trace), args.num_steps)}


def server_config(args, words: str, eagle3: bool):
    """One server's settings as eval_gpu.py makes them; a baseline takes its own words after the shared ones."""
    extra = args.extra_args if eagle3 else [*args.extra_args, *shlex.split(words)]
    return engine_config(SimpleNamespace(engine="sglang", k=args.k, concurrency=[1], requests_per_point=None,
                                         extra_args=extra, speculative_args=words if eagle3 else "", device="cuda"))


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.extra_args is None:
        args.extra_args = default_server_args("sglang", "cuda")
    if args.speculative_args is None:
        args.speculative_args = [""]
    saved, out = Path(args.saved), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # (mode, words, drafter): the plain baseline, the EAGLE-3 servers, then the other baselines (the least needed
    # last, for a run cut short by its time limit).
    servers = [("baseline", "", None)]
    drafter = saved / "drafter" / "sglang"
    servers += [(f"eagle3-{i + 1}", words, drafter) for i, words in enumerate(args.speculative_args)]
    servers += [(f"baseline-{i + 1}", words, None) for i, words in enumerate(args.baseline_args)]
    report = {"probe": "sglang_profile", "note": "SGLang's own torch profiler, concurrency 1", "k": args.k,
              "activities": args.activities, "num_steps": args.num_steps, "extra_args": args.extra_args,
              "servers": {}}
    for mode, words, drafter in servers:
        cfg = server_config(args, words, eagle3=drafter is not None)
        try:
            result = {"server_args": words, **profile_server(mode, args, cfg, saved / "target", drafter, out)}
        except EngineError as exc:  # one server that will not start (a bad flag, say) leaves the others to run
            result = {"server_args": words, "error": str(exc).split("\n")[0]}
        report["servers"][mode] = result
        print(f"{mode} [{words or 'defaults'}]: " + ", ".join(
            f"{k} {result[k]:.2f}" for k in ("step_ms", "busy_per_step_ms", "idle_per_step_ms", "tpot_ms",
                                             "tpot_ms_under_profiler") if isinstance(result.get(k), float)),
              flush=True)
        base = report["servers"]["baseline"]
        if mode.startswith("eagle3") and "busy_per_step_ms" in base and "busy_per_step_ms" in result:
            result["iteration_in_baseline_steps"] = {
                "busy": result["busy_per_step_ms"] / base["busy_per_step_ms"],
                "step_under_profiler": result["step_ms"] / base["step_ms"],  # the profiler inflates EAGLE-3's more
            }
            print(f"  an EAGLE-3 iteration = {result['iteration_in_baseline_steps']['busy']:.2f} baseline steps of "
                  f"device time", flush=True)
        # Written after every server: a run cut short by its time limit keeps what it measured.
        (out / "sglang-profile.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


if __name__ == "__main__":
    main()
