"""EAGLE-3 training step: draftline's TTT step vs a straightforward one, side by side in one run (tokens/s, MFU, memory).

    python benchmarks/train.py            # H200 sizes: hidden 4096, target vocab 128256, draft vocab 32000, seq 2048, k=7
    python benchmarks/train.py --cpu      # demo sizes on CPU (hidden 256, vocab 4096, draft 2048, seq 512, k=3)
    python benchmarks/train.py --cpu --tiny   # seconds: a smoke run of both implementations (hidden 64, seq 128)

"draftline" = draftline.drafter.ttt (exact TTT attention; chunked losses whose fp32 logits never exist for all rows at
once); "straightforward" = fp32 target logits over the whole vocabulary, masked softmax, plain causal SDPA per unrolled
step and the draft layer written plainly; on a GPU also the key-layout variants "draftline-per-step-keys" and
"draftline-cat-keys". Each runs in its own spawned process, so peak memory is its own. Needs only torch and
draftline/drafter (no transformers, no Prefect). Writes benchmarks/results/train-<hw>.json.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import platform
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftline.drafter.model import Eagle3Config, Eagle3Drafter, apply_rope, repeat_kv, rope_cos_sin  # noqa: E402
from draftline.drafter import ttt as ttt_module  # noqa: E402
from draftline.drafter.ttt import TTTModel, loss_plan  # noqa: E402
from device_time import union_length  # noqa: E402  (benchmarks/device_time.py)

GPU_SIZES = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, draft_vocab=32000, seq=2048,
                 rows=2, steps=7, chunk=2048)
TINY_SIZES = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=512, draft_vocab=128, seq=128,
                  rows=2, steps=3, chunk=64)
CPU_SIZES = dict(hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=4096, draft_vocab=2048, seq=512,
                 rows=2, steps=3, chunk=1024)


def build(sizes: dict, device: torch.device, last: torch.Tensor) -> tuple[Eagle3Drafter, torch.Tensor]:
    """The drafter and the target's lm_head. Its draft vocabulary holds every token the target predicts for the
    batch's last states (then random others), as a vocabulary built from the target's own outputs would; with a
    random one, 3 in 4 positions would leave the loss and the draft lm_head would run on a quarter of the rows."""
    h = sizes["hidden"]
    cfg = Eagle3Config(hidden_size=h, intermediate_size=sizes["intermediate"], num_attention_heads=sizes["heads"],
                       num_key_value_heads=sizes["kv_heads"], head_dim=h // sizes["heads"], vocab_size=sizes["vocab"],
                       draft_vocab_size=sizes["draft_vocab"], target_hidden_size=h, aux_layer_ids=[2, 16, 29],
                       max_position_embeddings=max(4096, sizes["seq"]))
    torch.manual_seed(0)
    model = Eagle3Drafter(cfg)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lm_head = (torch.randn(sizes["vocab"], h) * h ** -0.5).to(device, dtype)
    predicted = torch.unique(target_predictions(last, lm_head)).cpu()[: sizes["draft_vocab"]]
    others = torch.ones(sizes["vocab"], dtype=torch.bool)
    others[predicted] = False
    fill = others.nonzero()[:, 0]
    fill = fill[torch.randperm(fill.numel())[: sizes["draft_vocab"] - predicted.numel()]]
    used = torch.sort(torch.cat([predicted, fill])).values
    t2d = torch.zeros(sizes["vocab"], dtype=torch.bool)
    t2d[used] = True
    model.set_vocab(used - torch.arange(sizes["draft_vocab"]), t2d)
    return model.to(device), lm_head


def target_predictions(last: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """The target's greedy token at each position [R*T], from its last hidden states, 1024 rows of logits at a time."""
    flat = last.reshape(-1, lm_head.shape[1]).to(lm_head.dtype)
    return torch.cat([(flat[a:a + 1024] @ lm_head.t()).argmax(-1) for a in range(0, flat.shape[0], 1024)])


def loss_rows_per_step(model: Eagle3Drafter, lm_head: torch.Tensor, b: dict, steps: int) -> list[int]:
    """Rows that enter TTT step j's loss (the draft lm_head runs on these only): slot t predicts the target's token
    at t+1+j when that lies inside the sequence and in the draft vocabulary."""
    r, t = b["input_ids"].shape
    in_vocab = model.t2d[target_predictions(b["last"], lm_head)].view(r, t)
    return [int(in_vocab[:, 1 + j: t - 1].sum()) for j in range(steps)]


def batch(sizes: dict, device: torch.device) -> dict:
    r, t, h = sizes["rows"], sizes["seq"], sizes["hidden"]
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(0, sizes["vocab"], (r, t), generator=g).to(device),
        "loss_mask": torch.ones(r, t, dtype=torch.bool, device=device),
        "doc_ids": torch.zeros(r, t, dtype=torch.long, device=device),
        "position_ids": torch.arange(t, device=device).expand(r, t).contiguous(),
        "aux": torch.randn(r, t, 3 * h, generator=g).to(device, dtype),
        "last": torch.randn(r, t, h, generator=g).to(device, dtype),
    }


def plain_qkv(layer, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor):
    """The draft layer's attention half as first written: fp32 norm outputs, autocast casting per projection."""
    b, t, _ = hidden.shape
    cfg, att = layer.cfg, layer.self_attn
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
    q = att.q_proj(x).view(b, t, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
    k = att.k_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
    v = att.v_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
    cos, sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, q.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def plain_finish(layer, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    b, _, t, _ = attn.shape
    h = hidden + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
    x = layer.post_attention_layernorm(h)
    return h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x))


def straightforward_loss(model: Eagle3Drafter, lm_head: torch.Tensor, b: dict, steps: int) -> torch.Tensor:
    """The first implementation anyone writes: fp32 logits over the full target vocabulary, masked softmax."""
    r, t = b["input_ids"].shape
    target_logits = (b["last"].float() @ lm_head.float().t())  # [R, T, V] fp32, all at once
    in_vocab = model.t2d[target_logits.argmax(-1)]
    masked = target_logits.masked_fill(~model.t2d, float("-inf"))
    target_p = torch.softmax(masked, -1)[..., model.draft_token_ids]  # renormalised over the draft vocabulary
    hidden = model.fc(b["aux"].to(model.fc.weight.dtype))
    loss = 0.0
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    for j in range(steps):
        shift = 1 + j
        tokens = torch.zeros_like(b["input_ids"])
        tokens[:, : t - shift] = b["input_ids"][:, shift:]
        q, k, v = plain_qkv(model.midlayer, model.embed_tokens(tokens), hidden, b["position_ids"] + j)
        attn = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True)
        hidden = plain_finish(model.midlayer, hidden, attn)
        logp = torch.log_softmax(model.lm_head(model.norm(hidden)).float(), -1)
        valid = torch.zeros(r, t, dtype=torch.bool, device=hidden.device)
        valid[:, : t - shift - 1] = in_vocab[:, shift: t - 1]
        p = torch.zeros_like(target_p)
        p[:, : t - shift] = target_p[:, shift:]
        step_loss = -(p * logp).sum(-1)
        loss = loss + 0.8 ** j * (step_loss * valid).sum() / valid.sum().clamp(min=1)
    return loss


def matmul_flops_per_step(sizes: dict, loss_rows: list[int]) -> float:
    """Useful matmul FLOPs of one training step (forward + backward = 3x for trained matmuls): the draft layer on every
    token of every unrolled step, the draft lm_head on the rows in each step's loss (loss_rows), which is all draftline
    computes it on; the straightforward step's lm_head over every other row is not counted as useful."""
    h, i, v, vd, t, k = sizes["hidden"], sizes["intermediate"], sizes["vocab"], sizes["draft_vocab"], sizes["seq"], sizes["steps"]
    tokens = sizes["rows"] * t
    hd = h // sizes["heads"]
    q, kv = sizes["heads"] * hd, sizes["kv_heads"] * hd
    layer = 2 * (2 * h * (q + 2 * kv) + q * h + 3 * h * i)
    attention = 2 * 2 * q * (t / 2)  # causal QK^T and PV, half the keys on average
    fc = 2 * 3 * h * h  # its input (the target's states) needs no gradient: forward + weight gradient only
    target = 2 * h * v  # the target's lm_head, forward only
    return tokens * (2 * fc + 3 * k * (layer + attention) + target) + 3 * 2 * h * vd * sum(loss_rows)


def run_impl(name: str, sizes: dict, device_kind: str, iters: int, warmup: int, threads: int, queue,
             profile: str | None = None, flex_mode: str | None = None) -> None:
    device = torch.device(device_kind)
    ttt_module.FLEX_COMPILE_MODE = flex_mode
    if device.type == "cpu":
        torch.set_num_threads(threads)
    b = batch(sizes, device)
    model, lm_head = build(sizes, device, b["last"])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if device.type == "cuda" else {}))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    ttt = None  # the straightforward step keeps the model as built (fp32 frozen embeddings included)
    if name.startswith("draftline"):
        ttt = TTTModel(model, lm_head, sizes["steps"], sizes["chunk"], "flex" if device.type == "cuda" else "eager",
                       torch.bfloat16 if device.type == "cuda" else torch.float32,
                       one_key_shape=name != "draftline-per-step-keys",
                       key_slots=False if name == "draftline-cat-keys" else None)
    weights = torch.tensor([0.8 ** j for j in range(sizes["steps"])], device=device)
    host_mask, host_docs = b["loss_mask"].cpu(), b["doc_ids"].cpu()  # the batch as the trainer collates it

    def step() -> torch.Tensor:
        """One training step as draftline's trainer runs it: the loss plan made on the host beside the batch
        (pinned, copied without a wait), and the loss read after the next step is queued, not at once."""
        with autocast:
            if name.startswith("draftline"):
                plan = loss_plan(host_mask, host_docs, sizes["steps"])
                if device.type == "cuda":
                    plan = plan.pin_memory()
                loss_sum, count, _, _ = ttt(**b, plan=plan.to(device, non_blocking=True))
                loss = (weights * loss_sum / count.clamp(min=1)).sum()
            else:
                loss = straightforward_loss(model, lm_head, b, sizes["steps"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    try:
        for _ in range(warmup):
            step()
        sync()
        if profile:  # where a step's time goes, kernel by kernel, instead of the timing
            write_profile(step, sync, iters, Path(profile))
            queue.put({"impl": name, "ok": True, "profile": profile})
            return
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        losses = [step() for _ in range(iters)]
        sync()
        losses = [float(x) for x in losses]
        elapsed = time.perf_counter() - t0
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        tokens = sizes["rows"] * sizes["seq"] * iters
        if not all(map(math.isfinite, losses)):  # the time of a step that computes garbage is no result
            queue.put({"impl": name, "ok": False, "error": f"loss not finite in the timed steps: {losses}",
                       "step_s_not_a_result": elapsed / iters})
            return
        queue.put({"impl": name, "ok": True, "tokens_per_s": tokens / elapsed, "step_s": elapsed / iters,
                   "peak_memory_bytes": int(peak), "loss_first": losses[0], "loss": losses[-1]})
    except torch.cuda.OutOfMemoryError as exc:  # the straightforward step may not fit; that is a result too
        queue.put({"impl": name, "ok": False, "error": f"out of memory: {str(exc).splitlines()[0]}"})


KERNEL_KINDS = (("flex attention", ("flex_attention",)), ("matmul", ("nvjet", "gemm", "cutlass", "sm90_xmma")),
                ("compiled elementwise (inductor)", ("triton_",)), ("optimizer", ("multi_tensor_apply",)),
                ("copies and casts", ("copy", "Memcpy", "Memset")))


def write_profile(step, sync, iters: int, path: Path) -> None:
    """Profile `iters` steps with torch.profiler: the kernels' table (most device time first), a per-step summary
    of device-busy time against wall time by kind of kernel, and a Chrome trace (PATH.trace.json.gz)."""
    import gzip
    import shutil as sh

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    key = "self_cpu_time_total"
    if torch.cuda.is_available():
        key = next((k for k in ("self_device_time_total", "self_cuda_time_total") if hasattr(events[0], k)), key)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy, by_kind = union_length((e.time_range.start, e.time_range.end) for e in kernels), {}
    for e in kernels:
        kind = next((k for k, marks in KERNEL_KINDS if any(m in e.name for m in marks)), "other elementwise and reductions")
        by_kind[kind] = by_kind.get(kind, 0.0) + e.time_range.elapsed_us()
    lines = [f"{iters} steps, {wall / iters * 1e3:.1f} ms a step (wall, under the profiler); device busy "
             f"{busy / iters / 1e3:.1f} ms a step, idle {(wall * 1e6 - busy) / iters / 1e3:.1f} ms"]
    lines += [f"  {kind:<34} {us / iters / 1e3:8.1f} ms a step" for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1])]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + f"\nsorted by {key}\n"
                    + events.table(sort_by=key, row_limit=80, max_name_column_width=90) + "\n")
    trace = path.with_suffix(".trace.json")
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        sh.copyfileobj(src, dst)
    trace.unlink()
    print("\n".join(lines))
    print(f"wrote {path} and {trace}.gz")


def measured_peak_tflops(device: torch.device) -> float:
    """bf16 (GPU) or fp32 (CPU) matmul throughput, the denominator of MFU."""
    n = 8192 if device.type == "cuda" else 1024
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    reps = 20 if device.type == "cuda" else 5
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


def hardware_name(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        for known in ("h200", "h100", "a100", "l40s", "b200"):
            if known in name:
                return known
        return name.replace(" ", "-")
    return "cpu"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="demo sizes on CPU")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke run of seconds (with --cpu)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=INT", help="override a size, e.g. rows=1")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (oversubscribed OpenMP crawls on a shared box)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/train-<hw>.json)")
    parser.add_argument("--flex-mode", default=None, metavar="MODE",
                        help="torch.compile mode for flex attention, e.g. max-autotune-no-cudagraphs (not yet measured)")
    parser.add_argument("--impls", default=None, metavar="A,B",
                        help="only these implementations (a quick look; the JSON's ratios need draftline and straightforward)")
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="instead of timing: profile draftline's step and write the kernel table to PATH")
    args = parser.parse_args()

    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    sizes = dict(TINY_SIZES if args.tiny else CPU_SIZES if device.type == "cpu" else GPU_SIZES)
    for item in args.set:
        key, value = item.split("=", 1)
        sizes[key] = int(value)
    iters = args.iters or (3 if device.type == "cpu" else 10)
    warmup = args.warmup or (1 if device.type == "cpu" else 3)

    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    peak = measured_peak_tflops(device)
    ctx = mp.get_context("spawn")
    results = {}
    # On a GPU also draftline with each TTT step's own key length, as before all steps shared one (flex kernels
    # compiled per shape): what the one shape costs or saves per step, measured in the same run.
    impls = ("draftline", "straightforward") + (("draftline-per-step-keys", "draftline-cat-keys")
                                                if device.type == "cuda" else ())
    if args.profile:
        impls = ("draftline",)
    elif args.impls:
        impls = tuple(args.impls.split(","))
    for impl in impls:
        queue = ctx.Queue()
        proc = ctx.Process(target=run_impl, args=(impl, sizes, device.type, iters, warmup, args.threads, queue,
                                                  args.profile, args.flex_mode))
        proc.start()
        proc.join()
        results[impl] = queue.get() if not queue.empty() else {"impl": impl, "ok": False,
                                                               "error": f"exit code {proc.exitcode}"}

    if args.profile:
        return 0 if results["draftline"]["ok"] else 1
    b = batch(sizes, device)  # the same batch and vocabulary as each implementation's process
    model, lm_head = build(sizes, device, b["last"])
    loss_rows = loss_rows_per_step(model, lm_head, b, sizes["steps"])
    del b, model, lm_head
    if device.type == "cuda":
        torch.cuda.empty_cache()
    flops = matmul_flops_per_step(sizes, loss_rows)
    for r in results.values():
        if r["ok"]:
            r["tflops"] = flops / r["step_s"] / 1e12
            r["mfu"] = r["tflops"] / peak
    missing = {"ok": False, "error": "not run (--impls)"}
    ours, plain = results.get("draftline", missing), results.get("straightforward", missing)
    hw = hardware_name(device)
    summary = {
        "benchmark": "train", "hardware": hw, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__, "sizes": sizes, "iters": iters, "measured_peak_tflops": peak,
        "matmul_flops_per_step": flops, "loss_rows_per_step": loss_rows,
        "flex_compile_mode": args.flex_mode,
        "loss_rows_fraction": sum(loss_rows) / (sizes["rows"] * sizes["seq"] * sizes["steps"]), "results": results,
        "train_mfu": ours.get("mfu"),
        "train_tokens_per_s": ours.get("tokens_per_s"),
        "peak_memory_ratio_vs_straightforward": (ours["peak_memory_bytes"] / plain["peak_memory_bytes"]
                                                 if ours["ok"] and plain["ok"] else None),
        "speedup_vs_straightforward": (ours["tokens_per_s"] / plain["tokens_per_s"] if ours["ok"] and plain["ok"] else None),
        "goals": {"train_mfu": ">= 0.65 (GPU)", "peak_memory_ratio_vs_straightforward": "<= 0.6"},
        "memory_note": "GPU: torch.cuda.max_memory_allocated; CPU: peak RSS of the process (includes torch itself)",
    }
    print(f"EAGLE-3 training step on {summary['device']} ({hw}), sizes {sizes}, measured matmul peak {peak:.3f} TFLOP/s")
    print(f"{'implementation':<24} {'tokens/s':>10} {'step s':>8} {'TFLOP/s':>8} {'MFU':>6} {'peak GB':>8}")
    for r in results.values():
        if r["ok"]:
            print(f"{r['impl']:<24} {r['tokens_per_s']:>10.0f} {r['step_s']:>8.3f} {r['tflops']:>8.3f} {r['mfu']:>6.3f} "
                  f"{r['peak_memory_bytes'] / 1e9:>8.2f}")
        else:
            print(f"{r['impl']:<24} failed: {r['error']}")
    if summary["peak_memory_ratio_vs_straightforward"] is not None:
        print(f"peak memory ratio vs straightforward: {summary['peak_memory_ratio_vs_straightforward']:.3f}; "
              f"speedup {summary['speedup_vs_straightforward']:.2f}x")
    out = Path(args.out or Path(__file__).parent / "results" / f"train-{hw}{'-tiny' if args.tiny else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
