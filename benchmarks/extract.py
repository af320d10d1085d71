"""Hidden-state extraction speed: matmul peak, hooked forward (MFU), disk bandwidth, full extraction, the naive way.

GPU (H200):  python benchmarks/extract.py            (torch + transformers only; no Prefect, no pydantic)
CPU (demo):  python benchmarks/extract.py --cpu      (tokens/s on assets/demo-llama and assets/demo-deepseek)

Prints a table and writes benchmarks/results/extract-<hw>.json. On GPU every figure comes from ONE run:
  forward_mfu                   = 2 x decoder-layer params x tokens/s / measured bf16 matmul peak
  fraction_of_binding_ceiling   = full-extraction tokens/s / min(forward tokens/s, fsync'd disk B/s / bytes per token)
We store 3 aux states + the last state in bf16: 4 x H x 2 B = 8 x H bytes per token, the floor the issue names,
plus 9 bytes of input_ids (int64) and loss_mask (uint8); nothing else (no other layers, no logits, no fp32).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftline.extract import HiddenStateExtractor, SafetensorsStream, ShardPlan, run_overlapped  # noqa: E402
from draftline.store import LocalStore  # noqa: E402
from draftline.target import decoder_layers, default_aux_layer_ids  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat: int = 3, warmup: int = 1) -> float:
    """Best wall time of `repeat` runs after `warmup` runs, in seconds."""
    for _ in range(warmup):
        fn()
    sync(device)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def matmul_peak(device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    reps = 20 if device.type == "cuda" else 1
    t = timed(lambda: [a @ b for _ in range(reps)], device)
    return 2 * n**3 * reps / t


def disk_bandwidth(folder: Path, total: int, chunk: int = 64 << 20) -> float:
    """Bytes/s of a sequential write with fsync, like the store's atomic publish."""
    data = os.urandom(chunk)
    path = folder / "disk-probe.bin"
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, total // chunk)):
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t
    size = path.stat().st_size
    path.unlink()
    return size / elapsed


def llama_1b(device):
    """A Llama-3.2-1B-shaped target with random weights (speed does not depend on the values)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.eval()


def layer_params(model) -> int:
    return sum(p.numel() for p in decoder_layers(model).parameters())


def forward_only(extractor: HiddenStateExtractor, sequences, batch_tokens: int):
    """The hooked forward with the device gather, but no host copy: what the GPU alone can do."""
    from draftline.extract import length_buckets

    h = extractor.hidden_size
    dev = extractor.device
    batches = length_buckets([len(s) for s in sequences], batch_tokens)
    inputs = []
    for batch in batches:
        width = max(len(sequences[i]) for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, : len(sequences[i])] = torch.tensor(sequences[i])
        inputs.append(ids.to(dev))
    n_max = max(x.numel() for x in inputs)
    aux = torch.empty((n_max, 3 * h), dtype=torch.bfloat16, device=dev)
    last = torch.empty((n_max, h), dtype=torch.bfloat16, device=dev)
    from draftline.target import capture_hidden_states

    def run():
        with torch.inference_mode():
            for ids in inputs:
                n = ids.numel()

                def sink(name, hidden):
                    rows = hidden.reshape(-1, h)
                    if name == "last":
                        last[:n].copy_(rows)
                    else:
                        s = int(name[-1])
                        aux[:n, s * h:(s + 1) * h].copy_(rows)

                with capture_hidden_states(extractor.model, extractor.aux_layer_ids, sink):
                    extractor.decoder(input_ids=ids, use_cache=False)

    return run


def full_extraction(extractor: HiddenStateExtractor, shards: list[list[list[int]]], batch_tokens: int, root: Path):
    """The library's own path: bucketed forward, pinned host copies, writer thread streaming reproducible
    safetensors into a local store (temp file + fsync + rename per shard). Returns a callable."""
    store = LocalStore(str(root))

    def write(plan, traces, order, cu, aux, last):
        ids = torch.tensor([t for i in order for t in traces[i]["input_ids"]], dtype=torch.int64)
        mask = torch.ones_like(ids, dtype=torch.uint8)
        tensors = {"input_ids": ids, "loss_mask": mask, "cu_seqlens": cu, "aux_hidden_states": aux,
                   "last_hidden_states": last}
        store.put_stream(f"bench/hidden/shard-{plan.index:05d}.safetensors",
                         SafetensorsStream(tensors, {"aux_layer_ids": json.dumps(extractor.aux_layer_ids)}))

    def run():
        jobs = ((ShardPlan(i, [], sum(map(len, s)), len(s)), [{"input_ids": x} for x in s]) for i, s in enumerate(shards))
        run_overlapped(extractor, jobs, write, batch_tokens)

    return run


def naive(model, sequences, aux_ids, folder: Path, device):
    """What people write first: one sample at a time, output_hidden_states=True, synchronous torch.save."""

    def run():
        with torch.inference_mode():
            for j, seq in enumerate(sequences):
                out = model(torch.tensor([seq], device=device), output_hidden_states=True)
                hs = out.hidden_states
                torch.save({"input_ids": torch.tensor(seq), "aux": torch.cat([hs[k][0] for k in aux_ids], -1).cpu(),
                            "last": hs[-1][0].cpu()}, folder / f"sample-{j}.pt")
    return run


def random_sequences(n: int, length: int, vocab: int, seed: int = 0, jitter: bool = False):
    g = torch.Generator().manual_seed(seed)
    lengths = [length - (int(torch.randint(0, length // 4, (1,), generator=g)) if jitter else 0) for _ in range(n)]
    return [torch.randint(10, vocab, (m,), generator=g).tolist() for m in lengths]


def gpu_bench(args) -> dict:
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = matmul_peak(device)
    model = llama_1b(device)
    L, H = model.config.num_hidden_layers, model.config.hidden_size
    params = layer_params(model)
    extractor = HiddenStateExtractor(None, default_aux_layer_ids(L), device="cuda", model=model)
    if args.compile:
        for layer in decoder_layers(model):
            layer.forward = torch.compile(layer.forward, dynamic=False)
    seq_len, batch_tokens = args.seq_len, args.batch_tokens
    per_shard = args.tokens_per_shard // seq_len
    shards = [random_sequences(per_shard, seq_len, model.config.vocab_size, seed=i) for i in range(args.shards)]
    fwd_seqs = shards[0]
    t_fwd = timed(forward_only(extractor, fwd_seqs, batch_tokens), device)
    fwd_tps = len(fwd_seqs) * seq_len / t_fwd
    mfu = 2 * params * fwd_tps / peak
    bytes_per_token = 8 * H + 8 + 1
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        disk = disk_bandwidth(Path(tmp), args.disk_probe_bytes)
        total_tokens = sum(map(len, (x for s in shards for x in s)))
        t_full = timed(full_extraction(extractor, shards, batch_tokens, Path(tmp) / "store"), device, repeat=2)
        full_tps = total_tokens / t_full
        naive_seqs = fwd_seqs[: args.naive_samples]
        (Path(tmp) / "naive").mkdir()
        t_naive = timed(naive(model, naive_seqs, extractor.aux_layer_ids, Path(tmp) / "naive", device), device,
                        repeat=1)
        naive_tps = len(naive_seqs) * seq_len / t_naive
    ceiling = min(fwd_tps, disk / bytes_per_token)
    return {
        "hardware": name, "torch": torch.__version__, "target": "Llama-3.2-1B-shaped, random weights, bf16, SDPA",
        "compiled": args.compile, "layers": L, "hidden": H, "decoder_layer_params": params,
        "aux_layer_ids": extractor.aux_layer_ids, "seq_len": seq_len, "batch_tokens": batch_tokens,
        "tokens_per_shard": per_shard * seq_len, "shards": args.shards,
        "matmul_peak_tflops": peak / 1e12,
        "forward_tokens_per_s": fwd_tps, "forward_mfu": mfu,
        "disk_fsync_write_gb_per_s": disk / 1e9,
        "bytes_per_token": bytes_per_token, "bytes_per_token_floor": 8 * H,
        "disk_bound_tokens_per_s": disk / bytes_per_token,
        "binding_ceiling": "forward" if fwd_tps <= disk / bytes_per_token else "disk",
        "binding_ceiling_tokens_per_s": ceiling,
        "full_extraction_tokens_per_s": full_tps, "fraction_of_binding_ceiling": full_tps / ceiling,
        "naive_tokens_per_s": naive_tps, "speedup_vs_naive": full_tps / naive_tps,
        "goals": {"forward_mfu": 0.6, "fraction_of_binding_ceiling": 0.8},
    }


def cpu_bench(args) -> dict:
    device = torch.device("cpu")
    rows = {}
    for kind in ("llama", "deepseek"):
        target = REPO / "assets" / f"demo-{kind}"
        extractor = HiddenStateExtractor(target, None, device="cpu")
        vocab = extractor.model.config.vocab_size
        seqs = random_sequences(args.cpu_sequences, args.cpu_seq_len, vocab, jitter=True)
        tokens = sum(map(len, seqs))
        t_fwd = timed(forward_only(extractor, seqs, args.cpu_batch_tokens), device, repeat=2)
        with tempfile.TemporaryDirectory() as tmp:
            half = len(seqs) // 2
            t_full = timed(full_extraction(extractor, [seqs[:half], seqs[half:]], args.cpu_batch_tokens,
                                           Path(tmp)), device, repeat=2)
        rows[kind] = {"forward_tokens_per_s": tokens / t_fwd, "full_extraction_tokens_per_s": tokens / t_full,
                      "tokens": tokens, "hidden": extractor.hidden_size,
                      "bytes_per_token": 8 * extractor.hidden_size + 9}
    # Shared CI machines run other jobs: the load average says how much of the CPU these figures had.
    return {"hardware": platform.processor() or platform.machine(), "cpu_threads": torch.get_num_threads(),
            "load_average_1m": os.getloadavg()[0],
            "torch": torch.__version__, "targets": rows}


def print_table(result: dict) -> None:
    width = max(len(k) for k in result)
    for k, v in result.items():
        if isinstance(v, float):
            v = f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
        print(f"  {k:<{width}}  {v}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="CPU mode: tokens/s on the demo targets")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (GPU)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=16384, help="tokens per forward (>= 16k on the H200)")
    ap.add_argument("--tokens-per-shard", type=int, default=65536)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--naive-samples", type=int, default=16)
    ap.add_argument("--disk-probe-bytes", type=int, default=4 << 30)
    ap.add_argument("--workdir", default=None, help="folder on the disk to measure (default: the temp dir)")
    ap.add_argument("--cpu-sequences", type=int, default=16)
    ap.add_argument("--cpu-seq-len", type=int, default=256)
    ap.add_argument("--cpu-batch-tokens", type=int, default=2048)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/extract-<hw>.json)")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu for the demo-target figures")
    result = cpu_bench(args) if args.cpu else gpu_bench(args)
    hw = "cpu" if args.cpu else "".join(c for c in result["hardware"].lower().split()[-1] if c.isalnum())
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"extract-{hw}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"hidden-state extraction benchmark ({result['hardware']})")
    if args.cpu:
        for kind, row in result["targets"].items():
            print(f" demo-{kind}:")
            print_table(row)
    else:
        print_table(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
