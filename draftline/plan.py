"""Predict what a pipeline run costs before it starts: tokens, bytes, wall time, GPU-hours, memory per device and disk, per stage, from measured rates (the rules: draftline.plan_model)."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from draftline.config import PipelineConfig, ServerSettings
from draftline.errors import ConfigError
from draftline.plan_data import HARDWARE, PUBLISHED_SHAPES, Hardware, published_shape, rate
from draftline.plan_model import Model, drafter_from_rate_tuple, model_for, pipelined_s
from draftline.plan_shape import (DrafterShape, TargetShape, hidden_state_bytes, stored_weight_bytes, target_shape,
                                  trace_bytes)
from draftline.state_storage import BF16, FP8_E4M3, bytes_per_token

GB = 1e9
# Assumed when the prompts cannot be read here (stated in the plan's assumptions).
DEFAULT_TRACES = 10_000
DEFAULT_PROMPT_TOKENS = 256
DEFAULT_TEXT_BYTES_PER_TOKEN = 4.0
PROMPTS_SAMPLED = 2000
# vLLM's --gpu-memory-utilization when extra_args set none.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass
class Workload:
    """How many traces, how long, and what was assumed rather than read."""

    traces: int
    prompt_tokens: float  # mean per trace
    answer_tokens: float  # mean per trace
    text_bytes_per_token: float
    assumptions: list[str] = field(default_factory=list)

    @property
    def trace_tokens(self) -> float:
        return self.prompt_tokens + self.answer_tokens

    @property
    def tokens(self) -> float:
        return self.traces * self.trace_tokens


# ---------------------------------------------------------------- inputs

def target_for_plan(config: PipelineConfig) -> tuple[dict, TargetShape, list[str]]:
    """The target's config and shape: its config.json when target.path is here, else a published shape matched by
    the folder's name."""
    from draftline.target import read_target_config

    root = Path(config.target.path)
    name = config.target.display_name
    if (root / "config.json").is_file():
        cfg = read_target_config(root)
        size, source = stored_weight_bytes(root) or (None, None)
        return cfg, target_shape(cfg, name, size, source), []
    published = published_shape(name)
    if published:
        known, spec = published
        cfg = {"text_config": spec["config"]}
        note = (f"target.path {root} is not on this machine: planned with {known}'s published shape "
                f"({spec['source']})")
        return cfg, target_shape(cfg, known, spec.get("weight_bytes"), spec.get("weight_bytes_source")), [note]
    raise ConfigError(f"target.path {root} has no config.json here and {name!r} is none of the published shapes "
                      f"({', '.join(PUBLISHED_SHAPES)}); plan on a machine that has the checkpoint's config.json")


def workload(config: PipelineConfig, traces: int | None = None, prompt_tokens: float | None = None,
             answer_tokens: float | None = None) -> Workload:
    """Traces and their lengths: given, else read from the prompts (tokenized with the target's tokenizer and chat
    template), else assumed, each assumption said."""
    cfg = config.traces
    notes: list[str] = []
    prompts = _read_prompts(config)
    if traces is None:
        if prompts is not None:
            traces = len(prompts)
        else:
            traces = DEFAULT_TRACES
            notes.append(f"{cfg.prompts} is not readable here: {DEFAULT_TRACES:,} traces assumed (--traces N)")
    text_bytes = DEFAULT_TEXT_BYTES_PER_TOKEN
    if prompt_tokens is None:
        measured = _prompt_lengths(config, prompts) if prompts else None
        if measured is not None:
            prompt_tokens, text_bytes, dropped = measured
            if dropped:
                traces = max(1, round(traces * (1 - dropped)))
                notes.append(f"{dropped:.1%} of the prompts reach traces.max_total_tokens and are dropped")
        else:
            prompt_tokens = DEFAULT_PROMPT_TOKENS
            notes.append(f"prompt lengths unknown here: {DEFAULT_PROMPT_TOKENS} tokens a prompt assumed "
                         "(--prompt-tokens N)")
    if text_bytes == DEFAULT_TEXT_BYTES_PER_TOKEN:
        notes.append(f"{DEFAULT_TEXT_BYTES_PER_TOKEN:g} bytes of text per answer token assumed in the traces' size")
    if answer_tokens is None:
        answer_tokens = max(0.0, min(cfg.max_new_tokens, cfg.max_total_tokens - prompt_tokens))
        notes.append(f"answers assumed as long as traces.max_new_tokens allows ({answer_tokens:,.0f} tokens): an "
                     "upper bound; pass --answer-tokens N with a measured mean")
    return Workload(int(traces), float(prompt_tokens), float(answer_tokens), text_bytes, notes)


def _read_prompts(config: PipelineConfig) -> list[dict] | None:
    from draftline.traces import load_prompts

    if not Path(config.traces.prompts).is_file():
        return None
    return load_prompts(config.traces)


def _prompt_lengths(config: PipelineConfig, prompts: list[dict]) -> tuple[float, float, float] | None:
    """(mean prompt tokens of the kept prompts, text bytes per token, share dropped as too long) over the first
    PROMPTS_SAMPLED prompts, with the target's tokenizer; None without one."""
    from draftline.traces import encode_prompt

    root = Path(config.target.path)
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(root))
    sample = prompts[:PROMPTS_SAMPLED]
    lengths, text, kept_tokens = [], 0, 0
    for p in sample:
        ids = encode_prompt(tok, p, config.traces.use_chat_template, image_refusal=None)  # an image: one token here
        if len(ids) < config.traces.max_total_tokens:
            lengths.append(len(ids))
            text += len(tok.decode(ids, skip_special_tokens=True).encode("utf-8"))
            kept_tokens += len(ids)
    if not lengths:
        raise ConfigError(f"every prompt of {config.traces.prompts} reaches traces.max_total_tokens="
                          f"{config.traces.max_total_tokens}; raise it")
    return statistics.mean(lengths), text / kept_tokens, 1 - len(lengths) / len(sample)


# ---------------------------------------------------------------- the plan

def server_gpus(settings: ServerSettings, gpus: int | None, gpus_split: int | None = None) -> tuple[int, int]:
    """(devices of one server, the devices one copy of the weights is split over); --gpus N: all N, each copy on
    `gpus_split` of them."""
    from draftline.engines.parallel import devices_needed, flag_value

    if gpus is not None:
        return gpus, gpus_split or gpus
    return devices_needed(settings), settings.tensor_parallel_size * flag_value(
        list(settings.extra_args), "--pipeline-parallel-size", "-pp")


def _utilization(settings: ServerSettings) -> float:
    args = list(settings.extra_args)
    for flag in ("--gpu-memory-utilization", "--mem-fraction-static"):
        for i, a in enumerate(args):
            if a == flag and i + 1 < len(args):
                return float(args[i + 1])
            if a.startswith(flag + "="):
                return float(a.split("=", 1)[1])
    return DEFAULT_GPU_MEMORY_UTILIZATION


def _engine_memory(shape: TargetShape, hw: Hardware, settings: ServerSettings, split: int, field_name: str,
                   capture_bytes_per_token: int = 0) -> dict:
    """Weights and KV room per device of one server; refuses a target that cannot fit."""
    weights = shape.weight_bytes / split
    budget = hw.memory_gb * GB * (_utilization(settings) if hw.hbm_tb_per_s else 1.0)
    if weights > budget:
        what = f"{hw.memory_gb:g} GB x {_utilization(settings):g}" if hw.hbm_tb_per_s else f"{hw.memory_gb:g} GB"
        raise ConfigError(f"{field_name}: {shape.name}'s {shape.weight_bytes / GB:,.0f} GB of weights need "
                          f"{weights / GB:,.1f} GB on each of {split} devices but each {hw.name} gives "
                          f"{budget / GB:,.1f} GB ({what}); spread the server over more devices or use devices with more memory")
    kv = shape.kv_bytes_per_token() if shape.mla_kv_width else shape.kv_bytes_per_token() / max(1, split)
    per_token = kv + capture_bytes_per_token
    room = budget - weights
    return {"weights_gb": weights / GB, "budget_gb": budget / GB, "kv_room_gb": room / GB,
            "tokens_in_flight": int(room / per_token) if per_token else None}


def _start(model: Model, shape: TargetShape, settings: ServerSettings, first: bool) -> float:
    """A vLLM server's start: the machine's first (JIT and imports cold) or the capture server's after the traces
    server's; graphs or eager."""
    fixed = model.engine_first_start_s if first else model.engine_capture_after_traces_s
    graphs = 0.0 if _eager(settings) else model.engine_graphs_extra_s
    return fixed + graphs + shape.weight_bytes / model.weights_read_bytes_per_s


def _eager(settings: ServerSettings) -> bool:
    return "--enforce-eager" in settings.extra_args


def plan_hardware(config: PipelineConfig, hardware: str | None = None, calibrated: bool = False) -> str:
    """The hardware key a plan is for: `hardware`, else cpu when train.device is cpu, else h200; refuses an unknown
    key, and a calibration (it times this machine's CPU) for a GPU plan, each in one sentence."""
    key = hardware or ("cpu" if config.train.device == "cpu" else "h200")
    if key not in HARDWARE:
        raise ConfigError(f"--hardware {key}: unknown; use one of {', '.join(HARDWARE)}")
    if calibrated and HARDWARE[key].hbm_tb_per_s is not None:
        raise ConfigError(f"--calibrate times this machine's CPU and applies to CPU plans only, not to "
                          f"{HARDWARE[key].name}; drop --calibrate or plan with --hardware cpu")
    return key


def _tensor_parallel(config: PipelineConfig, target_cfg: dict, gpus: int | None, notes: list[str]) -> int | None:
    """The GPUs each copy of the target is split over with --gpus N (the most of N that split its heads, as config init
    writes); without it, every engine server's tensor-parallel size must split the heads."""
    from draftline.engines.parallel import server_heads_problem, tensor_parallel_split
    from draftline.inputs import engine_servers

    if gpus is not None:
        tp, dp = tensor_parallel_split(target_cfg, gpus)
        if dp > 1:
            notes.append(f"--gpus {gpus}: each engine server splits the target over {tp} GPUs (the most that split its "
                         f"heads) and runs {dp} copies (--data-parallel-size {dp})")
        return tp
    for where, settings in engine_servers(config):
        why = server_heads_problem(target_cfg, settings, f"{where}.tensor_parallel_size")
        if why:
            raise ConfigError(why)
    return None


def build_plan(config: PipelineConfig, traces: int | None = None, gpus: int | None = None,
               hardware: str | None = None, prompt_tokens: float | None = None, answer_tokens: float | None = None,
               rates: dict[str, float] | None = None, target: tuple[dict, TargetShape] | None = None,
               machine: dict | None = None) -> dict:
    """The plan as a JSON-able dict; ConfigError (one sentence) when the target cannot fit the devices. `target`
    (config dict, shape) stands in for target.path's checkpoint; `machine` (calibration()'s answer) scales a CPU
    plan to the machine that was probed."""
    hw_key = plan_hardware(config, hardware, calibrated=machine is not None)
    hw = HARDWARE[hw_key]
    model = model_for(hw_key, rates, machine)
    target_cfg, shape, notes = (*target, []) if target is not None else target_for_plan(config)
    gpus_split = _tensor_parallel(config, target_cfg, gpus, notes)
    work = workload(config, traces, prompt_tokens, answer_tokens)
    ctx = work.trace_tokens
    on_gpu = hw.hbm_tb_per_s is not None
    stages = []

    # traces
    t_cfg = config.traces
    t_dev, t_split = server_gpus(t_cfg.vllm, gpus, gpus_split) if t_cfg.backend == "vllm" else (1, 1)
    t_dev, t_split = (t_dev, t_split) if on_gpu else (0, 1)
    trace_stage = {"stage": "traces", "tokens": work.tokens, "generated_tokens": work.traces * work.answer_tokens,
                   "gpus": t_dev, "bytes": trace_bytes(work.tokens, work.traces * work.answer_tokens, work.traces,
                                                        shape.vocab, work.text_bytes_per_token)}
    traces_on_vllm = t_cfg.backend == "vllm" and not t_cfg.endpoint
    if traces_on_vllm:
        conc = min(t_cfg.batch_size, work.traces)
        g, split = max(1, t_dev), max(1, t_split)
        # Data-parallel copies share the requests in flight; each copy's step reads its own weights over its split.
        per_copy = max(1.0, conc / max(1, g // split))
        step = model.decode_step_s(shape, per_copy, split, _eager(t_cfg.vllm), ctx)
        generation = work.traces * work.answer_tokens / conc * step
        prefill = work.traces * work.prompt_tokens * model.prefill_s(shape, work.prompt_tokens) / g
        start = _start(model, shape, t_cfg.vllm, first=True)
        trace_stage.update(engine_start_s=start, work_s=generation + prefill, wall_s=start + generation + prefill,
                           concurrency=conc, step_ms=step * 1e3)
        if on_gpu:
            trace_stage["memory_per_device"] = _engine_memory(shape, hw, t_cfg.vllm, t_split, "traces.vllm")
    else:
        trace_stage.update(wall_s=None, note="traces.backend transformers (or an endpoint): not modelled; the planner "
                                             "models traces through a vLLM server it starts")
    stages.append(trace_stage)

    # extraction
    e_cfg = config.extract
    bpt = bytes_per_token(shape.hidden, e_cfg.storage)
    if e_cfg.backend == "vllm":
        e_dev, e_split = server_gpus(e_cfg.vllm, gpus, gpus_split)
        e_dev = e_dev if on_gpu else 0
        compute = max(1, e_dev) / model.prefill_s(shape, ctx)
        # After the traces server the engine's caches are filled (one machine, or a team deployment's kept cache
        # folder), but the capture server is a new kind; without a vLLM traces stage this is the run's first start.
        start = _start(model, shape, e_cfg.vllm, first=not traces_on_vllm)
    else:
        e_dev, e_split = (1 if on_gpu else 0), 1
        compute = 1 / model.prefill_s(shape, ctx, transformers=True)
        start = model.transformers_load_s + shape.weight_bytes / model.weights_read_bytes_per_s
    disk_rate = model.disk_bytes_per_s / (bpt + 9)
    rate_ = min(compute, disk_rate)
    extract_s = pipelined_s(work.tokens, e_cfg.tokens_per_shard, compute, disk_rate)
    hidden = {s: hidden_state_bytes(work.tokens, work.traces, shape.hidden, s) for s in (BF16, FP8_E4M3)}
    extract_stage = {"stage": "extraction", "tokens": work.tokens, "gpus": e_dev, "engine_start_s": start,
                     "tokens_per_s": rate_, "bound_by": "disk" if disk_rate < compute else "compute",
                     "work_s": extract_s, "wall_s": start + extract_s,
                     "bytes": hidden[e_cfg.storage], "bytes_bf16": hidden[BF16], "bytes_fp8": hidden[FP8_E4M3]}
    if on_gpu and e_cfg.backend == "vllm":
        extract_stage["memory_per_device"] = _engine_memory(shape, hw, e_cfg.vllm, e_split, "extract.vllm",
                                                            capture_bytes_per_token=4 * shape.hidden * 2)
    stages.append(extract_stage)

    # training
    tr = config.train
    procs = gpus if gpus is not None else tr.processes
    drafter = _drafter_shape(config, target_cfg)
    loss_share = work.answer_tokens / max(1e-9, work.trace_tokens)
    context = min(ctx, tr.max_seq_len)
    flops_token = drafter.train_flops_per_token(tr.ttt_steps, context, loss_share)
    f = model.train_flops_per_s(drafter.hidden) * (procs if on_gpu else 1)  # CPU ranks share the same cores
    train_tokens = tr.max_steps * tr.tokens_per_batch
    passes = math.ceil(tr.max_steps / tr.val_every) if tr.val_fraction > 0 else 0
    val_s = passes * tr.val_fraction * work.tokens * flops_token / 3 / f
    per_process = tr.tokens_per_batch / procs
    memory = drafter.state_bytes() + _activation_bytes_per_token_step() * (drafter.hidden + drafter.intermediate) \
        * per_process * tr.ttt_steps
    train_s = train_tokens * flops_token / f + val_s + (model.train_warmup_s if on_gpu else 0.0)
    epochs = train_tokens / max(1.0, work.tokens * (1 - tr.val_fraction))
    train_stage = {"stage": "training", "tokens": train_tokens, "epochs": epochs, "gpus": procs if on_gpu else 0,
                   "flops_per_token": flops_token, "tokens_per_s": f / flops_token, "validation_s": val_s,
                   "wall_s": train_s, "work_s": train_s,
                   "memory_per_device": {"peak_gb": memory / GB, "state_gb": drafter.state_bytes() / GB},
                   "bytes": tr.keep_checkpoints * drafter.checkpoint_bytes()
                   + len(config.export.formats) * drafter.export_bytes()}
    if on_gpu and memory > hw.memory_gb * GB:
        raise ConfigError(f"train: each of {procs} processes needs about {memory / GB:,.0f} GB ({per_process:,.0f} "
                          f"tokens a step, {tr.ttt_steps} TTT steps) but a {hw.name} has {hw.memory_gb:g} GB; lower "
                          "train.tokens_per_batch or raise train.processes")
    stages.append(train_stage)

    if on_gpu and max(t_dev, e_dev, procs) > 1:
        notes.append("no multi-GPU run was measured: tensor and expert parallelism and data-parallel training are "
                     "taken as free, so for this target the times are lower bounds; --rate replaces a constant with "
                     "your own measurement")
    if on_gpu and shape.experts:
        measured = rate("extract_vllm_moe_engine_tokens_per_s_h100").setup["shape"]
        notes.append(f"routed experts run at {model.expert_flops_fraction:.2f} of the dense FLOP/s in vLLM's prefill "
                     f"({model.transformers_expert_fraction:.2f} in the transformers backend), as measured with "
                     f"{measured['num_experts_per_tok']} of {measured['num_experts']} experts a token on an H100 "
                     "against an H200's dense rate; "
                     f"this target picks {shape.experts_per_token} of {shape.experts}; a decoding step costs "
                     f"{model.decode_moe_step_s * 1e3:.2f} ms beyond its reads, measured one request at a time (a "
                     "24-layer MoE and Kimi-K2.5's own layers with 1 and 3 took alike, its MLA alone none; at 32 "
                     "their steps needed none). On those Kimi layers (8 of 384, bf16 and INT4 experts, an H100) the "
                     "plan held within 1.3x in prefill and decoding")
    if on_gpu and traces_on_vllm and e_cfg.backend == "vllm":
        notes.append(f"the traces server's start is a machine's first ({model.engine_first_start_s:.0f} s besides the "
                     "weights: FlashInfer's kernels built); the capture server's after it finds the caches it filled "
                     f"({model.engine_capture_after_traces_s:.0f} s): one machine, or a kept cache folder (the "
                     "Kubernetes templates' engine_cache_path); a pod without one pays the first start again")
    if config.store.root.startswith("s3://"):
        notes.append("store.root is S3: shards are written at the local disk's measured rate here; an upload to S3 "
                     "is often slower (--rate disk_bytes_per_s=...)")
    for s in stages:
        s["gpu_hours"] = None if s.get("wall_s") is None else s["wall_s"] * s["gpus"] / 3600
    spool = min(e_cfg.requests_in_flight, work.traces) * ctx * bpt if e_cfg.backend == "vllm" else 0.0
    common = trace_stage["bytes"] + train_stage["bytes"]
    disk = {"traces": trace_stage["bytes"], "hidden_states": hidden[e_cfg.storage], "spool": spool,
            "checkpoints_and_exports": train_stage["bytes"], "target_checkpoint": shape.weight_bytes,
            "offline": common + hidden[e_cfg.storage], "online": common + spool}
    return {"run": config.run, "target": shape.name, "hardware": hw.name, "hardware_key": hw_key,
            "rates_from": hw.scaling, "sources": model.sources, "calibration": machine,
            "shape": {"layers": shape.layers, "hidden": shape.hidden, "total_params": shape.total_params,
                      "active_params": shape.active_layer_params + 2 * shape.embedding_params,
                      "weight_bytes": shape.weight_bytes, "weight_bytes_source": shape.weight_bytes_source,
                      "prefill_flops_per_token": shape.prefill_flops(ctx)},
            "workload": {"traces": work.traces, "prompt_tokens": work.prompt_tokens,
                         "answer_tokens": work.answer_tokens, "trace_tokens": work.trace_tokens,
                         "tokens": work.tokens},
            "assumptions": notes + work.assumptions, "stages": stages, "disk": disk,
            "total_wall_s": sum(s["wall_s"] or 0.0 for s in stages),
            "total_gpu_hours": sum(s["gpu_hours"] or 0.0 for s in stages),
            "constants": {k: v for k, v in model.__dict__.items() if k not in ("hardware", "sources")}}


def _drafter_shape(config: PipelineConfig, target_cfg: dict) -> DrafterShape:
    from draftline.aux_ids import default_aux_layer_ids
    from draftline.drafter.target_sizing import config_for_target
    from draftline.plan_shape import drafter_shape
    from draftline.target import num_layers

    ids = default_aux_layer_ids(num_layers(target_cfg))
    warm = config.train.warm_start
    if warm and (Path(warm) / "config.json").is_file():
        from draftline.drafter.warm_start import warm_start_config

        return drafter_shape(warm_start_config(warm, target_cfg, config.drafter, ids))
    return drafter_shape(config_for_target(target_cfg, config.drafter, ids))


def _activation_bytes_per_token_step() -> float:
    """Training activations per token and TTT step per unit of (hidden + intermediate), from the measured peak of the
    H200 training step less its state."""
    r = rate("train_peak_memory_bytes")
    d = drafter_from_rate_tuple(r.setup["drafter"])
    return (r.value - d.state_bytes()) / (r.setup["tokens_per_process"] * r.setup["ttt_steps"]
                                          * (d.hidden + d.intermediate))


# ---------------------------------------------------------------- output

def _hours(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:.0f} B"


def render(plan: dict) -> str:
    """The plan as a plain-text table and its notes."""
    w = plan["workload"]
    cal = plan.get("calibration")
    scaled = (f"; calibrated: this machine's cores run the probe {cal['per_core_speed']:.2f}x as fast as the rates' "
              f"machine and other work's {cal['other_threads']:.1f} threads leave {cal['share']:.0%} of its "
              f"{cal['cores']} cores: the engine's rates x {cal['engine_speed']:.2f}; torch's threads run "
              f"{cal['torch_speed']:.2f}x: training's x {cal['torch_speed']:.2f}" if cal else "")
    lines = [f"draftline plan for run {plan['run']!r}: {plan['target']} on {plan['hardware']} ({plan['rates_from']}"
             f"{scaled})",
             f"{w['traces']:,} traces of {w['trace_tokens']:,.0f} tokens ({w['prompt_tokens']:,.0f} prompt + "
             f"{w['answer_tokens']:,.0f} answer): {w['tokens']:,.0f} tokens", ""]
    head = ("stage", "tokens", "wall time", "of it start", "GPUs", "GPU-hours", "memory/device", "bytes")
    rows = []
    for s in plan["stages"]:
        mem = s.get("memory_per_device") or {}
        mem_text = (f"{mem['weights_gb']:.1f} GB weights" if "weights_gb" in mem else
                    f"{mem['peak_gb']:.1f} GB peak" if "peak_gb" in mem else "-")
        gh = "-" if s.get("gpu_hours") is None or not s["gpus"] else f"{s['gpu_hours']:,.2f}"
        rows.append((s["stage"], f"{s['tokens']:,.0f}", _hours(s.get("wall_s")), _hours(s.get("engine_start_s")),
                     str(s["gpus"] or "-"), gh, mem_text, _size(s["bytes"])))
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    for r in [head] + rows:
        lines.append("  ".join(str(c).ljust(wd) for c, wd in zip(r, widths)).rstrip())
    lines.append(f"traces, extraction and training: {_hours(plan['total_wall_s'])}, {plan['total_gpu_hours']:,.2f} "
                 "GPU-hours (evaluation not planned)")
    ex = next(s for s in plan["stages"] if s["stage"] == "extraction")
    d = plan["disk"]
    lines += ["", f"extraction: {ex['tokens_per_s']:,.0f} tokens/s, bound by the {ex['bound_by']}; hidden states "
              f"{_size(ex['bytes_bf16'])} in bf16, {_size(ex['bytes_fp8'])} in fp8-e4m3",
              f"disk: offline (every state stored) {_size(d['offline'])}; online (states streamed to training) "
              f"{_size(d['online'])} (spool {_size(d['spool'])}); the target's checkpoint "
              f"{_size(d['target_checkpoint'])}"]
    for s in plan["stages"]:
        mem = s.get("memory_per_device") or {}
        if "kv_room_gb" in mem:
            lines.append(f"{s['stage']} server: {mem['weights_gb']:.1f} GB weights of {mem['budget_gb']:.1f} GB per "
                         f"device; {mem['kv_room_gb']:.1f} GB left holds {mem['tokens_in_flight']:,} tokens in flight")
        if s.get("note"):
            lines.append(f"{s['stage']}: {s['note']}")
    for a in plan["assumptions"]:
        lines.append(f"note: {a}")
    return "\n".join(lines)


def write_plan(plan: dict, path: str | Path) -> Path:
    p = Path(path)
    p.write_text(json.dumps(plan, indent=1, default=float) + "\n")
    return p
