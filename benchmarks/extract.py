"""Hidden-state extraction speed per shard storage layout, next to the hooked forward alone, the disk and the naive way.

GPU (H200):  python benchmarks/extract.py --compile --writer-threads 6 --writer-sweep 3,8
CPU smoke:   python benchmarks/extract.py --cpu      (the same measurements on a tiny random Llama, seconds)
vLLM:        python benchmarks/extract.py --backend vllm [--target-shape 8b | --cpu]  (benchmarks/extract_vllm.py)

Measured in one run, per --layouts value (bf16, fp8-e4m3): the full extraction, paced, with --writer-threads shard
writers, and again without writes; the bf16 matmul peak, the hooked forward (forward_mfu), the fsync'd disk and the
shard writers alone; fraction_of_forward and fraction_of_binding_ceiling (definitions: benchmarks/RESULTS.md).
Needs torch, transformers and draftline's dependencies, pydantic among them (the GPU machine's python gets it from a
carried site on PYTHONPATH). Writes benchmarks/results/extract-compact-<hw>.json (extract-<hw>.json for bf16 alone).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.extract_workload import disk_bandwidth, random_sequences  # noqa: E402
from draftline.extract import HiddenStateExtractor, run_overlapped  # noqa: E402
from draftline.hidden_shards import HostShard, ShardPlan, length_buckets, write_hidden_shard  # noqa: E402
from draftline.state_storage import FP8_E4M3, STORAGES, quantize_slots  # noqa: E402
from draftline.store import base as store_module  # noqa: E402
from draftline.store import BackgroundFlush, LocalStore  # noqa: E402
from draftline.aux_ids import default_aux_layer_ids  # noqa: E402
from draftline.target import decoder_layers  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat: int = 3, warmup: int = 1, prepare=None) -> float:
    """Best wall time of `repeat` runs after `warmup` runs, in seconds; prepare() before each run, off the clock."""
    for _ in range(warmup):
        if prepare is not None:
            prepare()
        fn()
    sync(device)
    best = float("inf")
    for _ in range(repeat):
        if prepare is not None:
            prepare()
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def matmul_peak(device, n: int = 8192, dtype=torch.bfloat16) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    reps = 20 if device.type == "cuda" else 1
    t = timed(lambda: [a @ b for _ in range(reps)], device)
    return 2 * n**3 * reps / t


@contextlib.contextmanager
def patched(obj, name: str, value):
    """obj.name = value for the block: a switch of the store or the extractor, to measure with and without a change."""
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def pinned_source(nbytes: int, device) -> torch.Tensor:
    """Host bytes as the writers find them: a pinned buffer on a GPU machine (the extractor's staging memory)."""
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    return buf.pin_memory() if device.type == "cuda" else buf


def hash_only(source: torch.Tensor, threads: int) -> float:
    """Bytes/s of `threads` threads each taking the sha256 of the whole source at once (one core each)."""
    view = memoryview(source.numpy())

    def one(_):
        digest = hashlib.sha256()
        for start in range(0, len(view), 8 << 20):
            digest.update(view[start:start + (8 << 20)])

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))
    return threads * len(view) / (time.perf_counter() - t)


def write_only(folder: Path, source: torch.Tensor, threads: int) -> float:
    """Bytes/s of `threads` threads each writing the source into its own file as the store does, without hashing:
    unbuffered 8 MiB writes, a background flush every EARLY_WRITEBACK_BYTES, fsync at the end."""
    view = memoryview(source.numpy())

    def one(i):
        path = folder / f"write-only-{i}.bin"
        with open(path, "wb", buffering=0) as f:
            flush, flushed = BackgroundFlush(f.fileno()), 0
            for start in range(0, len(view), 8 << 20):
                f.write(view[start:start + (8 << 20)])
                if start + (8 << 20) - flushed >= store_module.EARLY_WRITEBACK_BYTES and flush.start():
                    flushed = start + (8 << 20)
            flush.wait()
            os.fsync(f.fileno())
        path.unlink()

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))
    return threads * len(view) / (time.perf_counter() - t)


def llama(device, tiny: bool = False):
    """A Llama-3.2-1B-shaped target (tiny: 8 layers, hidden 256) with random weights; speed does not depend on values."""
    from transformers import LlamaConfig, LlamaForCausalLM

    size = (dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2) if tiny else
            dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8))
    cfg = LlamaConfig(**size, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    with torch.device(device):
        # bf16 matmuls crawl on most CPUs: the smoke run computes in fp32 (the captured states are bf16 either way).
        model = LlamaForCausalLM(cfg).to(torch.float32 if tiny else torch.bfloat16)
    return model.eval()


def layer_params(model) -> int:
    return sum(p.numel() for p in decoder_layers(model).parameters())


def forward_only(extractor: HiddenStateExtractor, sequences, batch_tokens: int):
    """The hooked forward with the device gather, but no host copy: what the GPU alone can do."""
    from draftline.target import capture_hidden_states

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


class FreshFolder:
    """A new, empty folder for each run of a measurement that writes shards; the previous run's folder is deleted
    and synced first, off the clock (prepare=folder.next). On the H200 machine, 8 shards written over the previous
    run's (whose blocks the file system frees meanwhile) went at 1.2 to 1.4 GB/s, against 1.8 to 2.1 GB/s into a
    fresh folder, whatever memory the bytes came from (2026-12-01). A real extraction writes new shards."""

    def __init__(self, root: Path):
        self.root, self.runs, self.current = root, 0, None

    def next(self) -> None:
        self.remove()
        self.runs += 1
        self.current = self.root / f"run-{self.runs}"

    def remove(self) -> None:
        if self.current is not None:
            shutil.rmtree(self.current, ignore_errors=True)
            os.sync()

    def shard_bytes(self) -> int:
        """Bytes of the shard files the current run wrote."""
        return sum(p.stat().st_size for p in self.current.rglob("shard-*.safetensors")) if self.current else 0


def as_traces(sequences: list[list[int]]) -> list[dict]:
    return [{"id": f"t{j}", "input_ids": s, "loss_mask": [1] * len(s)} for j, s in enumerate(sequences)]


def full_extraction(extractor: HiddenStateExtractor, shards: list[list[list[int]]], batch_tokens: int,
                    folder: FreshFolder, writer_threads: int, max_batches_in_flight: int | None, timeline: list | None = None,
                    write_shards: bool = True):
    """The library's own path (draftline.extract.run_overlapped + write_hidden_shard): bucketed forward, copies into
    pinned per-batch buffers, shards written from them by a pool of writer threads into a local store (temp file,
    fsync, rename, completion record). Returns a callable.

    timeline: receives (what, shard, start, end) in seconds from the run's start for each shard's extract call (the
    host's issue of its batches) and write, so a run shows which side waited. write_shards=False: the writers only
    wait for the copies, i.e. the device and copy side alone. Each run writes into folder.current (time it with
    prepare=folder.next)."""
    traces = [as_traces(s) for s in shards]
    t0 = [0.0]

    def write(plan, shard_traces, host):
        start = time.perf_counter() - t0[0]
        if write_shards:
            write_hidden_shard(LocalStore(str(folder.current)), "bench", plan, "bench", extractor, shard_traces, host)
        else:
            host.wait()
        if timeline is not None:
            timeline.append(("write", plan.index, start, time.perf_counter() - t0[0]))

    issue = extractor.extract

    def timed_extract(sequences, batch_tokens, shard=None):
        start = time.perf_counter() - t0[0]
        host = issue(sequences, batch_tokens, shard=shard)
        timeline.append(("extract", shard, start, time.perf_counter() - t0[0]))
        return host

    def run():
        if timeline is not None:
            timeline.clear()
        t0[0] = time.perf_counter()
        jobs = ((ShardPlan(i, [], sum(map(len, s)), len(s)), traces[i]) for i, s in enumerate(shards))
        with patched(extractor, "extract", timed_extract) if timeline is not None else contextlib.nullcontext():
            run_overlapped(extractor, jobs, write, batch_tokens, writer_threads, max_batches_in_flight)

    return run


def timeline_summary(timeline: list) -> dict:
    """Where a full run's time went: the host's issue of all batches, the writes, and how they overlapped."""
    extracts = [e for e in timeline if e[0] == "extract"]
    writes = [e for e in timeline if e[0] == "write"]
    return {
        "extract_calls_s": round(sum(e[3] - e[2] for e in extracts), 3),
        "last_extract_end_s": round(max(e[3] for e in extracts), 3),
        "first_write_start_s": round(min(e[2] for e in writes), 3),
        "last_write_end_s": round(max(e[3] for e in writes), 3),
        "mean_write_s": round(sum(e[3] - e[2] for e in writes) / len(writes), 3),
        "events": [(what, shard, round(a, 3), round(b, 3)) for what, shard, a, b in sorted(timeline, key=lambda e: e[2])],
    }


def writer_only(extractor: HiddenStateExtractor, shards: list[list[list[int]]], folder: FreshFolder,
                writer_threads: int):
    """Just the shard writers (hash, write, fsync, publish) on host buffers filled beforehand: the host side alone.
    Each run writes into folder.current (time it with prepare=folder.next)."""
    h = extractor.hidden_size
    n = max(sum(map(len, s)) for s in shards)
    pinned = extractor.device.type == "cuda"
    aux = torch.randn((n, 3 * h)).to(torch.bfloat16)
    last = torch.randn((n, h)).to(torch.bfloat16)
    aux_scale = last_scale = torch.empty(0)
    if extractor.storage == FP8_E4M3:  # the host buffers as the extractor leaves them in this layout
        (aux, aux_scale), (last, last_scale) = quantize_slots(aux, 3), quantize_slots(last, 1)
    if pinned:
        aux, last = aux.pin_memory(), last.pin_memory()
    hosts = []
    for s in shards:
        lengths = list(map(len, s))
        cu = torch.tensor([0] + lengths).cumsum(0)
        m = int(cu[-1])
        scales = (dict(aux_scale_blocks=[aux_scale[:m]], last_scale_blocks=[last_scale[:m]])
                  if extractor.storage == FP8_E4M3 else {})
        hosts.append(HostShard(list(range(len(s))), cu, [aux[:m]], [last[:m]], storage=extractor.storage, **scales))
    traces = [as_traces(s) for s in shards]

    def run():
        store = LocalStore(str(folder.current))
        with ThreadPoolExecutor(writer_threads) as pool:
            futures = [pool.submit(write_hidden_shard, store, "writer-only", ShardPlan(i, [], 0, 0), "bench",
                                   extractor, traces[i], hosts[i]) for i in range(len(shards))]
            for f in futures:
                f.result()

    return run


def device_to_host_copy(device, nbytes: int) -> float:
    """Bytes/s of one contiguous device→host copy into pinned memory (the copy the extractor issues per batch)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    return nbytes / timed(lambda: dst.copy_(src, non_blocking=True), device)


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


def bench(args) -> dict:
    """Every figure from one run, on the GPU or (--cpu) on a tiny random Llama on the CPU."""
    device = torch.device("cpu" if args.cpu else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    peak = matmul_peak(device, n=1024, dtype=torch.float32) if args.cpu else matmul_peak(device)
    model = llama(device, tiny=args.cpu)
    L, H = model.config.num_hidden_layers, model.config.hidden_size
    params = layer_params(model)
    extractor = HiddenStateExtractor(None, default_aux_layer_ids(L), device=device.type, model=model)
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
    primary = args.layouts[-1]
    extractor.storage = primary
    bytes_per_token = extractor.bytes_per_token + 8 + 1  # + input_ids (int64) and loss_mask (uint8)
    copy_bw = device_to_host_copy(device, batch_tokens * extractor.bytes_per_token)
    total_tokens = sum(map(len, (x for s in shards for x in s)))
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        disk_plain = disk_bandwidth(Path(tmp), args.disk_probe_bytes)
        disk_early = disk_bandwidth(Path(tmp), args.disk_probe_bytes, early_flush=True)
        disk = max(disk_plain, disk_early)  # the ceiling is the best this disk did

        # The full extraction of each layout first, right after the disk probes: this disk wrote 2 to 3 GB/s early
        # in a run and 1.1 to 1.8 GB/s after some 70 GB of other measurements (2026-12-01), so its place matters.
        layouts, timeline = {}, []
        for layout in args.layouts:
            extractor.storage = layout
            folder = FreshFolder(Path(tmp) / f"store-{layout}")
            t_full = timed(full_extraction(extractor, shards, batch_tokens, folder, args.writer_threads,
                                           args.max_batches_in_flight, timeline), device, repeat=2, prepare=folder.next)
            shard_bytes = folder.shard_bytes()
            folder.remove()
            folder = FreshFolder(Path(tmp) / f"store-no-write-{layout}")
            t_no_write = timed(full_extraction(extractor, shards, batch_tokens, folder, args.writer_threads,
                                               args.max_batches_in_flight, write_shards=False),
                               device, repeat=1, prepare=folder.next)
            layouts[layout] = {
                "bytes_per_token": extractor.bytes_per_token + 8 + 1, "shard_bytes_per_token": shard_bytes / total_tokens,
                "full_extraction_tokens_per_s": total_tokens / t_full,
                "fraction_of_forward": total_tokens / t_full / fwd_tps,
                "full_extraction_without_writes_tokens_per_s": total_tokens / t_no_write,
                "full_extraction_timeline": timeline_summary(timeline),  # of the last repeat
            }
        extractor.storage = primary
        full_tps = layouts[primary]["full_extraction_tokens_per_s"]
        t_no_write = total_tokens / layouts[primary]["full_extraction_without_writes_tokens_per_s"]
        full_timeline = layouts[primary]["full_extraction_timeline"]
        def writers(n: int, tag: str, repeat: int = 2, warmup: int = 0) -> float:
            folder = FreshFolder(Path(tmp) / f"writer-only-{tag}")
            t = timed(writer_only(extractor, shards, folder, n), device, repeat=repeat, warmup=warmup,
                      prepare=folder.next)
            folder.remove()  # the disk holds the shards of one writer run at a time
            return total_tokens / t

        disk_after_full = disk_bandwidth(Path(tmp), args.disk_probe_bytes, early_flush=True)
        # As before the pacing: the host runs ahead until CUDA's launch queue blocks it (holding the GIL).
        folder = FreshFolder(Path(tmp) / "store-unpaced")
        with patched(extractor, "max_queued_batches", 1 << 30):
            t_unpaced = timed(full_extraction(extractor, shards, batch_tokens, folder, args.writer_threads,
                                              args.max_batches_in_flight), device, repeat=1, prepare=folder.next)
        folder.remove()
        # How many shard writers: each count measured alone on the same shards (after the full extraction).
        sweep = {n: writers(n, f"w{n}") for n in sorted({args.writer_threads, *args.writer_sweep})}
        best = max(sweep, key=sweep.get)
        with patched(store_module, "HASH_ON_THE_SIDE", False):  # as before: each writer hashes, then writes
            inline_hash = writers(best, "inline-hash", repeat=1)
        with patched(store_module, "EARLY_WRITEBACK_BYTES", 0):  # the flush left to the final fsync
            late_flush = writers(best, "late-flush", repeat=1)
        source = pinned_source(args.tokens_per_shard * bytes_per_token, device)  # one shard's bytes
        hash_gbs = hash_only(source, best)
        write_gbs = write_only(Path(tmp), source, best)
        del source
        naive_seqs = fwd_seqs[: args.naive_samples]
        (Path(tmp) / "naive").mkdir()
        t_naive = timed(naive(model, naive_seqs, extractor.aux_layer_ids, Path(tmp) / "naive", device), device,
                        repeat=1)
        naive_tps = len(naive_seqs) * seq_len / t_naive
        disk_at_end = disk_bandwidth(Path(tmp), args.disk_probe_bytes, early_flush=True)
    disk_probe = max(disk, disk_after_full, disk_at_end)
    # Several files written at once beat one file on this kind of disk (2026-12-01: 2.31 against 1.93 GB/s), so the
    # shard writers alone also measure the disk; the ceiling takes the best this disk did in the run.
    disk = max(disk_probe, sweep[best] * bytes_per_token)
    ceiling = min(fwd_tps, disk / bytes_per_token)
    for figures in layouts.values():
        bound = min(fwd_tps, disk / figures["bytes_per_token"])
        figures.update({"disk_bound_tokens_per_s": disk / figures["bytes_per_token"],
                        "binding_ceiling": "forward" if fwd_tps <= disk / figures["bytes_per_token"] else "disk",
                        "fraction_of_binding_ceiling": figures["full_extraction_tokens_per_s"] / bound})
    host_buffers = sum(b.numel() for b in extractor.host_pool._free)
    return {
        "hardware": name, "torch": torch.__version__,
        "target": "tiny Llama (CPU smoke), random weights, fp32, SDPA" if args.cpu else "Llama-3.2-1B-shaped, random weights, bf16, SDPA",
        "layout": primary, "fraction_of_forward": full_tps / fwd_tps,
        "compiled": args.compile, "layers": L, "hidden": H, "decoder_layer_params": params,
        "aux_layer_ids": extractor.aux_layer_ids, "seq_len": seq_len, "batch_tokens": batch_tokens,
        "tokens_per_shard": per_shard * seq_len, "shards": args.shards,
        "writer_threads": args.writer_threads, "max_batches_in_flight": args.max_batches_in_flight,
        "matmul_peak_tflops": peak / 1e12,
        "forward_tokens_per_s": fwd_tps, "forward_mfu": mfu,
        "device_to_host_pinned_gb_per_s": copy_bw / 1e9,
        "disk_fsync_write_gb_per_s": disk / 1e9,
        "disk_fsync_write_gb_per_s_single_file_probes": disk_probe / 1e9,
        "disk_fsync_write_gb_per_s_shard_writers_alone": sweep[best] * bytes_per_token / 1e9,
        "disk_fsync_write_gb_per_s_final_fsync_only": disk_plain / 1e9,
        "disk_fsync_write_gb_per_s_early_flush": disk_early / 1e9,
        "disk_fsync_write_gb_per_s_early_flush_after_full": disk_after_full / 1e9,
        "disk_fsync_write_gb_per_s_early_flush_at_end": disk_at_end / 1e9,
        "bytes_per_token": bytes_per_token, "bytes_per_token_floor": extractor.bytes_per_token,
        "shard_bytes_per_token": layouts[primary]["shard_bytes_per_token"],
        "disk_bound_tokens_per_s": disk / bytes_per_token,
        "writer_only_tokens_per_s": sweep[best],
        "writer_only_tokens_per_s_by_threads": {str(n): v for n, v in sweep.items()},
        "writer_only_hash_inline_tokens_per_s": inline_hash,
        "writer_only_final_fsync_only_tokens_per_s": late_flush,
        "hash_only_gb_per_s": hash_gbs / 1e9, "write_only_gb_per_s": write_gbs / 1e9,
        "hash_and_write_threads": best, "fastest_writer_threads_alone": best,
        "binding_ceiling": "forward" if fwd_tps <= disk / bytes_per_token else "disk",
        "binding_ceiling_tokens_per_s": ceiling,
        "full_extraction_tokens_per_s": full_tps, "fraction_of_binding_ceiling": full_tps / ceiling,
        "full_extraction_unpaced_tokens_per_s": total_tokens / t_unpaced,
        "full_extraction_without_writes_tokens_per_s": total_tokens / t_no_write,
        "full_extraction_timeline": full_timeline,
        "max_queued_batches": extractor.max_queued_batches,
        "host_buffer_gb": host_buffers / 1e9,
        "naive_tokens_per_s": naive_tps, "speedup_vs_naive": full_tps / naive_tps,
        "load_average_1m": os.getloadavg()[0],
        "layouts": layouts,
        "goals": {"forward_mfu": 0.6, "fraction_of_binding_ceiling": 0.8, "fraction_of_forward": 0.8},
    }


def print_table(result: dict) -> None:
    width = max(len(k) for k in result)
    for k, v in result.items():
        if isinstance(v, float):
            v = f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
        print(f"  {k:<{width}}  {v}")


def write_result(result: dict, out: str | None, default_name: str, title: str) -> None:
    """The JSON (at `out`, else benchmarks/results/`default_name`) and the printed table."""
    path = Path(out) if out else REPO / "benchmarks" / "results" / default_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{title} ({result['hardware']})")
    print_table(result)
    print(f"wrote {path}")


def parse_layouts(value: str) -> list[str]:
    layouts = [v for v in value.split(",") if v]
    bad = [v for v in layouts if v not in STORAGES]
    if bad or not layouts:
        raise argparse.ArgumentTypeError(f"{value!r}: layouts are extract.storage values: {', '.join(STORAGES)}")
    return layouts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="smoke run on the CPU: a tiny random Llama, small sizes (seconds)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (GPU)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (2048; --cpu: 64)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="tokens per forward (16384, >= 16k on the H200; --cpu: 256)")
    ap.add_argument("--tokens-per-shard", type=int, default=None, help="65536 (--cpu: 256)")
    ap.add_argument("--shards", type=int, default=None, help="8 (--cpu: 3)")
    ap.add_argument("--naive-samples", type=int, default=None, help="16 (--cpu: 2)")
    ap.add_argument("--disk-probe-bytes", type=int, default=None, help="4 GiB (--cpu: 64 MiB)")
    ap.add_argument("--writer-threads", type=int, default=6, help="shards written side by side in the full extraction (extract.writer_threads)")
    ap.add_argument("--writer-sweep", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                    help="more writer counts to measure, e.g. 6,8; the full extraction uses the fastest")
    ap.add_argument("--max-batches-in-flight", type=int, default=None, help="host batch buffers at most (extract.max_batches_in_flight)")
    ap.add_argument("--layouts", type=parse_layouts, default=["bf16", FP8_E4M3],
                    help="extract.storage layouts to measure side by side, comma-separated; the last is the primary "
                         "(default bf16,fp8-e4m3)")
    ap.add_argument("--workdir", default=None, help="folder on the disk to measure (default: the temp dir)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/extract-<hw>.json)")
    ap.add_argument("--backend", choices=["transformers", "vllm"], default="transformers",
                    help="vllm: the vLLM backend against the transformers backend side by side (benchmarks/extract_vllm.py)")
    ap.add_argument("--target-shape", choices=["1b", "8b", "moe", "moe-tiny"], default="1b",
                    help="--backend vllm: the inflated demo shape, or a random Qwen3-MoE (moe-tiny: with --cpu)")
    ap.add_argument("--sequences", type=int, default=None, help="--backend vllm: traces (128; --cpu: 24)")
    ap.add_argument("--requests-in-flight", type=int, default=64, help="--backend vllm: extract.requests_in_flight")
    ap.add_argument("--warmup-sequences", type=int, default=64,
                    help="--backend vllm: untagged requests served before the timed passes (not timed)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="--backend vllm: one vLLM flag or value (repeat), e.g. --server-arg=--enforce-eager")
    args = ap.parse_args()
    if args.backend == "vllm":
        from benchmarks.extract_vllm import bench_vllm

        if args.disk_probe_bytes is None:
            args.disk_probe_bytes = 4 << 30
        result = bench_vllm(args)
        name = "cpu" if args.cpu else f"h200-{args.target_shape}"
        write_result(result, args.out, f"extract-vllm-{name}.json", "extraction through vLLM against transformers")
        return
    sizes = (dict(seq_len=64, batch_tokens=256, tokens_per_shard=256, shards=3, naive_samples=2,
                  disk_probe_bytes=64 << 20) if args.cpu else
             dict(seq_len=2048, batch_tokens=16384, tokens_per_shard=65536, shards=8, naive_samples=16,
                  disk_probe_bytes=4 << 30))
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu for a smoke run")
    result = bench(args)
    hw = "cpu" if args.cpu else "".join(c for c in result["hardware"].lower().split()[-1] if c.isalnum())
    name = f"extract-{hw}.json" if args.layouts == ["bf16"] else f"extract-compact-{hw}.json"
    write_result(result, args.out, name, "hidden-state extraction benchmark")


if __name__ == "__main__":
    main()
