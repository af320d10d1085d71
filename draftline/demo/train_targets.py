"""Train one demo target on the tokenized corpus (GPU fast, CPU slow); needs only torch, transformers, numpy and safetensors.

Usage: python -m draftline.demo.train_targets --data DIR --target demo-llama --out DIR [--seconds S | --steps N]
DIR holds what `python -m draftline.demo.build data` wrote: data.json, train.npy, heldout.npy, heldout_chat.npy.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from draftline.demo.models import build_config


def load_streams(data_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    meta = json.loads((data_dir / "data.json").read_text())
    streams = {name: np.load(data_dir / f"{name}.npy", mmap_mode="r") for name in ("train", "heldout", "heldout_chat")}
    return meta, streams


def eval_windows(stream: np.ndarray, seq_len: int, count: int) -> torch.Tensor:
    """Evenly spaced, fixed windows, so every evaluation (and the untrained baseline) sees the same tokens."""
    count = min(count, (len(stream) - 1) // (seq_len + 1))
    starts = np.linspace(0, len(stream) - seq_len - 2, count).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s:s + seq_len + 1].astype(np.int64) for s in starts]))


@torch.no_grad()
def mean_loss(model, windows: torch.Tensor, device, batch: int, autocast) -> float:
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].to(device)
        with autocast():
            logits = model(input_ids=w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        n += w[:, 1:].numel()
    model.train()
    return total / n


def train(args) -> dict:
    data_dir, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta, streams = load_streams(data_dir)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    np_rng = np.random.default_rng(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    from transformers import AutoModelForCausalLM

    config = build_config(args.target, meta["special_ids"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").to(device)
    n_params = sum(p.numel() for p in model.parameters())

    def autocast():
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")

    heldout = eval_windows(streams["heldout"], args.seq_len, args.eval_windows)
    heldout_chat = eval_windows(streams["heldout_chat"], args.seq_len, args.eval_windows)
    untrained = mean_loss(model, heldout, device, args.batch_size, autocast)
    untrained_chat = mean_loss(model, heldout_chat, device, args.batch_size, autocast)
    print(f"[{args.target}] params {n_params/1e6:.2f}M, untrained held-out loss {untrained:.3f} (ppl {math.exp(untrained):.0f})", flush=True)

    train_stream = streams["train"]
    high = len(train_stream) - args.seq_len - 2

    def batch():
        starts = np_rng.integers(0, high, args.batch_size)
        x = np.stack([train_stream[s:s + args.seq_len + 1] for s in starts]).astype(np.int64)
        return torch.from_numpy(x).to(device, non_blocking=True)

    total_steps = args.steps
    calibrate = total_steps is None
    if calibrate:
        total_steps = 10**9  # set after timing the first steps, then fixed (recorded for --steps reruns)
    warmup = args.warmup_steps
    best = {"loss": float("inf"), "step": 0, "state": None}
    curve = []
    t0 = time.time()
    t_cal = t0  # reset at step 10, when warm-up compilation is over; read at step 30
    step = 0
    train_loss = float("nan")
    while step < total_steps:
        if calibrate and step == 30:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_cal) / 20
            total_steps = max(60, int((args.seconds - (time.time() - t0)) / (per_step * 1.08)) + step)
            print(f"[{args.target}] {per_step*1e3:.1f} ms/step -> {total_steps} steps", flush=True)
        if step == 10:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_cal = time.time()
        progress = min(1.0, step / total_steps) if not calibrate or step >= 30 else 0.0
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch()
        with autocast():
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.eval_every == 0 or step == total_steps:
            train_loss = loss.item()
            held = mean_loss(model, heldout, device, args.batch_size, autocast)
            curve.append({"step": step, "train_loss": round(train_loss, 4), "heldout_loss": round(held, 4),
                          "seconds": round(time.time() - t0, 1)})
            print(f"[{args.target}] step {step}/{total_steps} train {train_loss:.3f} held-out {held:.3f} "
                  f"({time.time()-t0:.0f}s)", flush=True)
            if held < best["loss"]:
                best = {"loss": held, "step": step,
                        "state": {k: v.detach().to("cpu", torch.bfloat16).clone() for k, v in model.state_dict().items()}}

    # Evaluate the kept (best held-out) weights exactly as they are shipped: rounded to bf16.
    model.load_state_dict({k: v.float() for k, v in best["state"].items()})
    final = mean_loss(model, heldout, device, args.batch_size, autocast)
    final_chat = mean_loss(model, heldout_chat, device, args.batch_size, autocast)
    save_file({k: v.contiguous() for k, v in best["state"].items()}, str(out / f"{args.target}.safetensors"))
    import transformers

    metrics = {
        "target": args.target,
        "parameters": n_params,
        "seed": args.seed,
        "steps": total_steps,
        "best_step": best["step"],
        "train_tokens_seen": total_steps * args.batch_size * args.seq_len,
        "train_tokens_in_corpus": int(len(train_stream)),
        "heldout_tokens_evaluated": int(heldout[:, 1:].numel()),
        "untrained_heldout_loss": round(untrained, 4),
        "untrained_heldout_ppl": round(math.exp(untrained), 2),
        "heldout_loss": round(final, 4),
        "heldout_ppl": round(math.exp(final), 3),
        "ppl_ratio_untrained_over_trained": round(math.exp(untrained - final), 1),
        "untrained_heldout_chat_loss": round(untrained_chat, 4),
        "heldout_chat_loss": round(final_chat, 4),
        "heldout_chat_ppl": round(math.exp(final_chat), 3),
        "training": {k: v for k, v in vars(args).items() if k not in ("data", "out")},
        "wall_seconds": round(time.time() - t0, 1),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "curve": curve,
    }
    metrics["training"]["steps"] = total_steps
    (out / f"{args.target}.metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"[{args.target}] done: held-out ppl {math.exp(final):.2f} vs untrained {math.exp(untrained):.0f} "
          f"(ratio {math.exp(untrained - final):.0f}x), best step {best['step']}", flush=True)
    return metrics


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--target", required=True, choices=["demo-llama", "demo-deepseek"])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=300.0, help="time budget; sets --steps after timing 30 steps")
    p.add_argument("--steps", type=int, default=None, help="fixed step count (reruns of a recorded training)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-windows", type=int, default=128)
    return p.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
