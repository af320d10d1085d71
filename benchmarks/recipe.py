"""Drafter recipe choices on the demo, one at a time: acceptance in the reference decoder, same traces, same time.

Each variant changes one setting of configs/demo.yaml's training (or how its traces are cut into shards), trains on
a copy of the demo's traces and shards, and runs the reference decoder on the eval prompts (k = 3). Variants whose
steps cost more or less than the baseline's get the steps that fill the baseline's training time (from a timed short
run of each); a second seed of the baseline gives the run-to-run spread the differences must exceed.

Run after `make demo` (reads ./runs/demo/traces and ./runs/demo/hidden), on an otherwise idle machine:
    .venv/bin/python benchmarks/recipe.py [--variants baseline,seed-1,...] [--demo-runs ./runs]
Writes benchmarks/results/recipe-cpu.json (variants run before and not again stay in it) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftline import stages  # noqa: E402
from draftline.config import PipelineConfig  # noqa: E402
from draftline.config_loading import load_config, merge_overrides, parse_config  # noqa: E402
from draftline.layout import export_prefix  # noqa: E402
from draftline.store import open_store  # noqa: E402

@dataclass(frozen=True)
class Variant:
    what: str
    overrides: dict[str, Any] = field(default_factory=dict)
    recount: bool = False  # its steps are re-counted to fill the baseline's training time
    shards_share: float = 1.0  # the share of the demo's hidden shards it trains on, the first shards (traces) first
    warm_from: str | None = None  # the variant whose trained drafter (SGLang export) it starts from
    steps_factor: float = 1.0  # its steps as a multiple of the baseline's


VARIANTS: dict[str, Variant] = {
    "baseline": Variant("configs/demo.yaml as it is"),
    "seed-1": Variant("the baseline with train.seed 1: the run-to-run spread", {"train": {"seed": 1}}),
    "lr-x2": Variant("learning rate 0.004 (twice)", {"train": {"learning_rate": 0.004}}),
    "lr-x0.5": Variant("learning rate 0.001 (half)", {"train": {"learning_rate": 0.001}}),
    "lr-floor-0.1": Variant("the cosine ends at 0.1 of the peak learning rate", {"train": {"min_lr_ratio": 0.1}}),
    "ttt-1": Variant("1 TTT step (no unrolling)", {"train": {"ttt_steps": 1}}, recount=True),
    "ttt-5": Variant("5 TTT steps", {"train": {"ttt_steps": 5}}, recount=True),
    "step-weight-1.0": Variant("every TTT step's loss weighted the same (step_weight_decay 1.0)",
                               {"train": {"step_weight_decay": 1.0}}),
    "step-weight-0.6": Variant("later TTT steps weighted less (step_weight_decay 0.6)",
                               {"train": {"step_weight_decay": 0.6}}),
    "vocab-1024": Variant("draft vocabulary 1024 tokens", {"drafter": {"draft_vocab_size": 1024}}, recount=True),
    "vocab-4096": Variant("draft vocabulary 4096 tokens", {"drafter": {"draft_vocab_size": 4096}}, recount=True),
    # A larger validation: whether the replayed estimate's distance to the reference decoder is the sample's size.
    "val-0.2": Variant("validation holds out 20% of the tokens", {"train": {"val_fraction": 0.2}}),
    # The demo's shards before 2026-12-03, when validation held out whole shards (then 1 of 2, not 1 of 8).
    "shards-32k": Variant("shards of 32,768 tokens", {"extract": {"tokens_per_shard": 32768}}),
    "shards-32k-seed-1": Variant("shards of 32,768 tokens with train.seed 1",
                                 {"extract": {"tokens_per_shard": 32768}, "train": {"seed": 1}}),
    # What a training minute buys: half and twice the baseline's steps (and time).
    "steps-x0.5": Variant("half the steps, half the training time", steps_factor=0.5),
    "steps-x2": Variant("twice the steps, twice the training time", steps_factor=2.0),
    # Optimizer updates against tokens per update, in the same time. The demo's batch was 4,096 tokens until 2026-12-05.
    "batch-4k": Variant("4,096 tokens a batch, steps re-counted to the same time",
                        {"train": {"tokens_per_batch": 4096}}, recount=True),
    "batch-1k": Variant("1,024 tokens a batch, steps re-counted to the same time",
                        {"train": {"tokens_per_batch": 1024}}, recount=True),
    # Data amount against epochs: half the traces, passed over twice as often in the same steps.
    "data-half": Variant("the first half of the traces' shards, the same steps", shards_share=0.5),
    # A warm start from a drafter of the same target trained on part of these traces (the nightly retraining case).
    "warm-data-half-steps-x0.5": Variant("warm start from data-half's drafter, all the traces, half the steps",
                                         warm_from="data-half", steps_factor=0.5),
}
CALIBRATION_STEPS = 20


def variant_run(name: str) -> str:
    """The store run a variant trains in."""
    return f"recipe-{name}"


def variant_config(base: PipelineConfig, name: str, overrides: dict, root: Path, steps: int | None = None
                   ) -> PipelineConfig:
    raw = merge_overrides(base.model_dump(mode="json"), overrides)
    raw["run"] = variant_run(name) if steps is None else f"recipe-calibrate-{name}"
    raw["store"]["root"] = str(root)
    raw["eval"]["engines"] = [e for e in raw["eval"]["engines"] if e["engine"] == "vllm"]
    raw["eval"]["reference"].update(aux_shifts=[], other_precision=False)
    if steps is not None:
        raw["train"].update(max_steps=steps, val_every=steps, checkpoint_every=steps, warmup_steps=min(
            raw["train"]["warmup_steps"], steps // 2))
    return parse_config(raw, PipelineConfig, f"recipe variant {name}")


def seeded_run(config: PipelineConfig, demo_runs: Path, demo: PipelineConfig, shards_share: float = 1.0) -> None:
    """The variant's run folder with the demo's traces, and its shards unless the variant cuts its own (the first
    `shards_share` of them); a run seeded by an earlier, interrupted invocation is kept, so a rerun goes on where it
    stopped."""
    run_dir = Path(config.store.root) / config.run
    if (run_dir / "traces").exists():
        return  # seeded before: the stages resume from what the run holds
    shutil.copytree(demo_runs / "demo" / "traces", run_dir / "traces")
    store = open_store(config.store.root)
    if config.extract == demo.extract:
        shutil.copytree(demo_runs / "demo" / "hidden", run_dir / "hidden")
    else:
        stages.extract(config, store)
    if shards_share < 1.0:  # training lists the shard files it finds; the manifest's other entries go unread
        shards = sorted((run_dir / "hidden").glob("shard-*.safetensors"))
        for extra in shards[max(1, round(len(shards) * shards_share)):]:
            extra.unlink()


def timed_training(config: PipelineConfig) -> tuple[dict, float]:
    store = open_store(config.store.root)
    t = time.perf_counter()
    training = stages.train(config, store)
    return training, time.perf_counter() - t


def train_tokens(training: dict) -> int | None:
    """The tokens training read, from the held-out tokens and their share in the training record."""
    held, share = training.get("val_tokens"), training.get("held_out_share")
    return round(held / share - held) if held and share else None


def donor_drafter(root: Path, donor: str) -> Path:
    """The trained drafter (SGLang export) of variant `donor`, which a warm-start variant starts from."""
    return root / export_prefix(variant_run(donor), "sglang")


def run_variant(base: PipelineConfig, name: str, root: Path, demo_runs: Path, baseline_step_s: float | None) -> dict:
    variant = VARIANTS[name]
    overrides = variant.overrides
    if variant.warm_from:
        overrides = merge_overrides(overrides, {"train": {"warm_start": str(donor_drafter(root, variant.warm_from))}})
    steps = max(1, round(base.train.max_steps * variant.steps_factor))
    calibration = None
    if variant.recount:
        probe = variant_config(base, name, overrides, root, steps=CALIBRATION_STEPS)
        shutil.rmtree(root / probe.run, ignore_errors=True)  # a timing: never resumed
        seeded_run(probe, demo_runs, base, variant.shards_share)
        _, seconds = timed_training(probe)
        step_s = seconds / CALIBRATION_STEPS
        steps = max(1, round(base.train.max_steps * baseline_step_s / step_s))
        calibration = {"seconds_per_step": step_s, "baseline_seconds_per_step": baseline_step_s}
        shutil.rmtree(root / probe.run)
    raw_overrides = merge_overrides(overrides, {"train": {"max_steps": steps, "val_every": max(1, steps // 2),
                                                          "checkpoint_every": max(1, steps // 2)}})
    config = variant_config(base, name, raw_overrides, root)
    seeded_run(config, demo_runs, base, variant.shards_share)
    training, train_s = timed_training(config)
    store = open_store(config.store.root)
    exports = stages.export(config, store)
    t = time.perf_counter()
    reference = json.loads(store.get_bytes(stages.reference(config, exports, store)))
    final_val = training.get("final_val") or {}
    by_k = (final_val.get("replayed") or {}).get("acceptance_length_by_k") or []  # index k - 1
    row = {"variant": name, "what": variant.what, "overrides": overrides, "shards_share": variant.shards_share,
           "steps": training["steps"], "train_s": round(train_s, 1),
           "calibration": calibration, "train_shards": len(training.get("train_shards") or []),
           "train_tokens": train_tokens(training),
           "val_shards": len(training.get("val_shards") or []),
           "val_sequences": training.get("val_sequences"), "held_out_share": training.get("held_out_share"),
           "draft_vocab_coverage": (training.get("vocab") or {}).get("coverage"),
           "validation_acceptance_length": final_val.get("acceptance_length"),
           "replayed_acceptance_length": (final_val.get("replayed") or {}).get("acceptance_length"),
           "replayed_rounds": (final_val.get("replayed") or {}).get("rounds"),
           "replayed_acceptance_length_k3": by_k[2] if len(by_k) >= 3 else None,
           "reference_acceptance_length": reference["mean_acceptance_length"],
           "reference_per_position": reference["per_position_acceptance"],
           "reference_s": round(time.perf_counter() - t, 1)}
    print(f"[{name}] {row['steps']} steps in {row['train_s']} s: reference tau {row['reference_acceptance_length']:.3f}",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--demo-runs", default=str(REPO / "runs"), help="the store `make demo` wrote (its demo run)")
    ap.add_argument("--store", default=str(REPO / "runs" / "recipe"), help="store folder for the variants' runs")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "recipe-cpu.json"))
    args = ap.parse_args()
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        sys.exit(f"--variants: {unknown} are not variants; choose from {', '.join(VARIANTS)}")
    root = Path(args.store).resolve()
    for i, n in enumerate(names):  # before any training: a warm start needs its donor trained earlier or in this run
        donor = VARIANTS[n].warm_from
        if donor and donor not in names[:i] and not (donor_drafter(root, donor) / "config.json").is_file():
            sys.exit(f"variant {n} starts from {donor}'s drafter, which {root} does not hold yet: run "
                     f"--variants {donor},{n}")
    demo_runs = Path(args.demo_runs).resolve()
    if not (demo_runs / "demo" / "hidden" / "manifest.json").is_file():
        sys.exit(f"{demo_runs / 'demo'} has no hidden states: run `make demo` first")
    os.chdir(REPO)  # the demo config's paths are relative to the repository root
    base = load_config(REPO / "configs" / "demo.yaml")
    root.mkdir(parents=True, exist_ok=True)
    # The baseline's seconds per step, timed like every recount's probe (same short run, same machine).
    probe = variant_config(base, "baseline", {}, root, steps=CALIBRATION_STEPS)
    shutil.rmtree(root / probe.run, ignore_errors=True)  # a timing: never resumed
    seeded_run(probe, demo_runs, base)
    baseline_step_s = timed_training(probe)[1] / CALIBRATION_STEPS
    shutil.rmtree(root / probe.run)
    rows = [run_variant(base, n, root, demo_runs, baseline_step_s) for n in names]
    out = Path(args.out)
    if out.is_file():  # an earlier invocation's variants stay beside this one's (each keeps its own calibration)
        rows = [r for r in json.loads(out.read_text())["variants"] if r["variant"] not in names] + rows
    by_name = {r["variant"]: r for r in rows}
    if "baseline" in by_name:
        b = by_name["baseline"]["reference_acceptance_length"]
        for r in rows:
            r["reference_vs_baseline"] = r["reference_acceptance_length"] / b
    import torch

    result = {"hardware": f"{platform.machine()}, {os.cpu_count()}-core CPU", "torch_threads": torch.get_num_threads(),
              "date": date.today().isoformat(), "config": "configs/demo.yaml", "baseline_steps": base.train.max_steps,
              "baseline_tokens_per_batch": base.train.tokens_per_batch,
              "baseline_seconds_per_step": baseline_step_s, "variants": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'variant':<16} {'steps':>5} {'train s':>8} {'reference tau':>14} {'vs baseline':>11} {'replayed k=3':>12}")
    for r in rows:
        print(f"{r['variant']:<16} {r['steps']:>5} {r['train_s']:>8.1f} {r['reference_acceptance_length']:>14.3f} "
              f"{r.get('reference_vs_baseline', float('nan')):>11.3f} {r['replayed_acceptance_length_k3'] or float('nan'):>12.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
