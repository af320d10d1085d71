"""What the way shards are made costs in acceptance: the same traces extracted per storage and backend, then trained.

The demo's traces are extracted once per extract.storage (with --backends, once per extraction backend), trained with
the same budget, then the reference decoder and vLLM run on the same eval prompts; also each run's bytes per token.
Run after `make demo` (reads ./runs/demo/traces); each storage gets its own resumable run in --store:
    .venv/bin/python benchmarks/storage_acceptance.py [--storages bf16,fp8-e4m3] [--store runs/storage-acceptance]
    .venv/bin/python benchmarks/storage_acceptance.py --storages bf16 --backends transformers,vllm
        --out benchmarks/results/backend-acceptance-cpu.json
On a GPU, the 1.04B inflated demo target (the demo's function, so the demo's traces are its traces):
    PYTHONPATH=<vllm site>:. python3 benchmarks/storage_acceptance.py --shape 1b
        --config benchmarks/configs/storage-acceptance-h200-1b.yaml --out benchmarks/results/storage-acceptance-h200.json
Prints a table and writes benchmarks/results/storage-acceptance-cpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftline import stages  # noqa: E402
from draftline.config_loading import load_config  # noqa: E402
from draftline.drafter.data import hidden_shard_keys, read_shard_tensors  # noqa: E402
from draftline.eval_result import EvalResult  # noqa: E402
from draftline.store import open_store  # noqa: E402


def stored_bytes_per_token(store, run: str) -> dict:
    manifest = store.read_manifest(f"{run}/hidden")
    tokens = sum(e.metadata["tokens"] for e in manifest)
    size = sum(e.size for e in manifest)
    return {"tokens": tokens, "shard_bytes": size, "bytes_per_token": size / tokens,
            "storage": sorted({e.metadata.get("storage", "bf16") for e in manifest})}


def same_as_demo_shards(store, run: str, demo_store) -> bool | None:
    """Do this run's shards read back equal to the demo's own (same traces, same target)? None: no demo shards."""
    try:
        demo_keys = hidden_shard_keys(demo_store, "demo")
    except Exception:
        return None
    keys = hidden_shard_keys(store, run)
    if len(keys) != len(demo_keys):
        return False
    import torch

    for ours, theirs in zip(keys, demo_keys):
        a, b = read_shard_tensors(store, ours), read_shard_tensors(demo_store, theirs)
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            return False
    return True


def run_storage(base, storage: str, root: Path, traces: Path, engines: bool = True, backend: str = "transformers"
                ) -> dict:
    run = f"storage-{storage}" if backend == "transformers" else f"{backend}-storage-{storage}"
    if not (root / run / "traces" / "manifest.json").is_file():
        shutil.copytree(traces, root / run / "traces", dirs_exist_ok=True)
    vllm = [e for e in base.eval.engines if e.engine == "vllm"] if engines else []
    config = base.model_copy(update={
        "run": run,
        "store": base.store.model_copy(update={"root": str(root)}),
        # The vLLM backend's server takes the trace stage's settings (the demo's: eager, no compile warm-up).
        "extract": base.extract.model_copy(update={"storage": storage, "backend": backend,
                                                   **({"vllm": base.traces.vllm} if backend == "vllm" else {})}),
        "eval": base.eval.model_copy(update={
            "engines": vllm, "reference": base.eval.reference.model_copy(update={"aux_shifts": []})}),
    })
    store = open_store(str(root))
    times = {}

    def timed(name, fn):
        t = time.perf_counter()
        out = fn()
        times[name] = round(time.perf_counter() - t, 1)
        print(f"[{run}] {name}: {times[name]} s", flush=True)
        return out

    extraction = timed("extract", lambda: stages.extract(config, store))
    training = timed("train", lambda: stages.train(config, store))
    exports = timed("export", lambda: stages.export(config, store))
    keys = timed("vllm", lambda: [stages.evaluate_engine(config, e, exports, store) for e in vllm]) if vllm else []
    ref_key = timed("reference", lambda: stages.reference(config, exports, store))
    if keys:
        timed("report", lambda: stages.report(config, store, keys, ref_key))
    ref = json.loads(store.get_bytes(ref_key))
    engine = EvalResult.model_validate_json(store.get_bytes(keys[0])) if keys else None
    other = ref.get("other_precision_acceptance") or {}
    return {
        "run": run, "backend": backend, "storage": storage, "seconds": times, "shards": stored_bytes_per_token(store, run),
        "extract_tokens_per_s": extraction.get("tokens_per_s"),
        "train_steps": training["steps"], "weights_digest": training.get("weights_digest"),
        "final_val": {k: (training.get("final_val") or {}).get(k)
                      for k in ("loss", "accuracy", "acceptance_length", "replayed")},
        "reference": {"mean_acceptance_length": ref["mean_acceptance_length"],
                      "per_position_acceptance": ref["per_position_acceptance"], "num_drafts": ref["num_drafts"],
                      "other_precision": {k: other.get(k) for k in ("dtype", "mean_acceptance_length", "kept_share")}
                      if other else None},
        "vllm": None if engine is None else {"engine_version": engine.engine_version, "status": engine.status,
                 "mean_acceptance_length": engine.acceptance.mean_acceptance_length if engine.acceptance else None,
                 "per_position_acceptance": engine.acceptance.per_position if engine.acceptance else None,
                 "by_concurrency": {str(p.concurrency): p.acceptance.mean_acceptance_length
                                    for p in engine.points if p.acceptance},
                 "parity": engine.parity.value if engine.parity else None},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--storages", default="bf16,fp8-e4m3", help="extract.storage values, comma-separated")
    ap.add_argument("--backends", default="transformers", help="extract.backend values, comma-separated")
    ap.add_argument("--store", default=str(REPO / "runs" / "storage-acceptance"), help="store folder for the runs")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "storage-acceptance-cpu.json"))
    ap.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"), help="the pipeline config of both runs")
    ap.add_argument("--shape", default=None, help="inflate the demo target to this shape (draftline.demo.inflate) "
                    "and use it as the config's target")
    ap.add_argument("--traces", default=str(REPO / "runs" / "demo" / "traces"), help="the traces both runs share")
    ap.add_argument("--no-engines", action="store_true", help="the reference decoder only (no vLLM installed)")
    args = ap.parse_args()
    base = load_config(args.config)
    root = Path(args.store).resolve()
    if args.shape:
        from extract_vllm import build_target  # benchmarks/extract_vllm.py

        root.mkdir(parents=True, exist_ok=True)
        target = root / f"demo-llama-{args.shape}"
        if not (target / "config.json").is_file():
            build_target(root, args.shape)
        base = base.model_copy(update={"target": base.target.model_copy(update={"path": str(target)})})
    traces = Path(args.traces).resolve()
    if not (traces / "manifest.json").is_file():
        sys.exit(f"{traces} has no manifest.json: run `make demo` first")
    os.chdir(REPO)  # the demo config's paths are relative to the repository root
    storages = [s for s in args.storages.split(",") if s]
    backends = [b for b in args.backends.split(",") if b]
    # Keyed by storage alone for the transformers backend (the layout comparison), "<backend>-<storage>" otherwise.
    runs = {(s if b == "transformers" else f"{b}-{s}"): run_storage(base, s, root, traces, not args.no_engines, b)
            for b in backends for s in storages}
    demo_store = open_store(str(REPO / "runs"))
    if "bf16" in runs and not args.shape:
        runs["bf16"]["reads_equal_to_demo_shards"] = same_as_demo_shards(open_store(str(root)), "storage-bf16",
                                                                         demo_store)
    import torch

    hardware = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                else f"{platform.machine()}, {os.cpu_count()}-core CPU")
    result = {"hardware": hardware, "date": date.today().isoformat(), "config": str(args.config),
              "target": base.target.path, "shape": args.shape, "train_max_steps": base.train.max_steps,
              "traces": str(traces), "runs": runs}
    if "bf16" in runs and "vllm-bf16" in runs:
        b, v = runs["bf16"], runs["vllm-bf16"]
        for where in ("reference", "vllm"):
            if b[where] and v[where] and b[where]["mean_acceptance_length"] and v[where]["mean_acceptance_length"]:
                v[f"{where}_acceptance_vs_transformers_backend"] = (v[where]["mean_acceptance_length"]
                                                                   / b[where]["mean_acceptance_length"])
    if "bf16" in runs and len(runs) > 1:
        b = runs["bf16"]
        for s, r in runs.items():
            if s == "bf16" or r["backend"] != "transformers":
                continue
            r["bytes_per_token_vs_bf16"] = r["shards"]["bytes_per_token"] / b["shards"]["bytes_per_token"]
            for where in ("reference", "vllm"):
                if r[where] is None or b[where] is None:
                    continue
                x, y = r[where]["mean_acceptance_length"], b[where]["mean_acceptance_length"]
                r[f"{where}_acceptance_vs_bf16"] = x / y if x and y else None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'shards':<14} {'B/token':>8} {'reference tau':>14} {'vLLM tau':>9} {'parity':>7}  (tau: mean acceptance "
          "length; shards: [backend-]storage)")
    for s, r in runs.items():
        print(f"{s:<14} {r['shards']['bytes_per_token']:>8.0f} {r['reference']['mean_acceptance_length']:>14.3f} "
              f"{(r['vllm'] or {}).get('mean_acceptance_length') or float('nan'):>9.3f} "
              f"{(r['vllm'] or {}).get('parity') or float('nan'):>7.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
