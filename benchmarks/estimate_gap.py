"""Where the training's offline acceptance estimate and the reference decoder's measured acceptance part, on the demo.

Runs the reference decoder with the demo's trained drafter on 32 prompts whose traces training validated on, at the
eval's length (--long: also at the traces' length; --repeat: the eval prompts again, to check determinism), beside the
validation's per-step accuracies; --offline replays the drafter's TTT unroll over the validation traces (per-step,
chain and walk figures), which separates what the estimate's formula assumes from what the prompts change.

Run after `make demo` (reads ./runs/demo, writes nothing there):
    .venv/bin/python benchmarks/estimate_gap.py --offline --long --repeat [--store runs/estimate-gap]
A run whose result.json is already in --store is not decoded again. Prints a table and writes
benchmarks/results/estimate-gap-cpu.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftline import stages  # noqa: E402
from draftline.config_loading import load_config  # noqa: E402
from draftline.drafter.data import hidden_shard_entries, hidden_shard_keys, split_validation  # noqa: E402
from draftline.drafter.ttt import acceptance_length  # noqa: E402
from draftline.store import open_store  # noqa: E402


def validation_parts(demo_root: Path, run: str, val_fraction: float) -> list:
    """The shard parts training validates on (draftline.drafter.data.split_validation), in shard order."""
    store = open_store(str(demo_root))
    keys = hidden_shard_keys(store, run)
    return split_validation(store, keys, hidden_shard_entries(store, run, keys), val_fraction)[1]


def validation_traces(demo_root: Path, run: str, val_fraction: float) -> list[dict]:
    """The traces (id, prompt_id, answer length) training validates on, in shard order."""
    from safetensors import safe_open

    ids: list[str] = []
    for part in validation_parts(demo_root, run, val_fraction):
        with safe_open(str(demo_root / part.key), "pt") as f:
            ids += json.loads(f.metadata()["trace_ids"])[part.start:part.stop]
    wanted, lengths = set(ids), {}
    for shard in sorted((demo_root / run / "traces").glob("shard-*.jsonl")):
        for line in shard.read_text().splitlines():
            row = json.loads(line)
            if row["id"] in wanted:
                lengths[row["id"]] = (row["prompt_id"], int(sum(row["loss_mask"])))
    return [{"id": i, "prompt_id": lengths[i][0], "answer_tokens": lengths[i][1]} for i in ids]


def spread(values: list[int]) -> dict:
    v = sorted(values)
    q = lambda p: v[min(len(v) - 1, int(p * len(v)))]  # noqa: E731
    return {"n": len(v), "mean": statistics.fmean(v), "min": v[0], "p10": q(0.1), "p50": q(0.5), "p90": q(0.9),
            "max": v[-1]}


def run_reference(base, name: str, root: Path, demo_root: Path, prompts: str, max_prompts: int,
                  max_new_tokens: int) -> dict:
    run = f"gap-{name}"
    drafter = root / run / "train" / "drafter"
    if not (drafter / "manifest.json").is_file():
        shutil.copytree(demo_root / base.run / "train" / "drafter", drafter, dirs_exist_ok=True)
    config = base.model_copy(update={
        "run": run,
        "store": base.store.model_copy(update={"root": str(root)}),
        "eval": base.eval.model_copy(update={
            "prompts": prompts, "max_prompts": max_prompts, "max_new_tokens": max_new_tokens,
            "reference": base.eval.reference.model_copy(update={"aux_shifts": [], "other_precision": False,
                                                                 "max_prompts": None})}),
    })
    store = open_store(str(root))
    key = stages.reference_key(config)
    seconds = None
    if not store.exists(key):
        t = time.perf_counter()
        key = stages.reference(config, {}, store)
        seconds = round(time.perf_counter() - t, 1)
        print(f"[{name}] reference: {seconds} s", flush=True)
    return summarize(json.loads(store.get_bytes(key)), prompts, max_prompts, max_new_tokens, seconds)


def summarize(ref: dict, prompts: str, max_prompts: int, max_new_tokens: int, seconds) -> dict:
    return {"prompts": prompts, "num_prompts": ref["num_prompts"], "max_new_tokens": max_new_tokens,
            "seconds": seconds, "mean_acceptance_length": ref["mean_acceptance_length"],
            "per_position_acceptance": ref["per_position_acceptance"],
            "conditional_acceptance": ref["conditional_acceptance"], "accepted_histogram": ref["accepted_histogram"],
            "num_drafts": ref["num_drafts"], "spec_tokens": ref["spec_tokens"],
            "mean_answer_tokens": ref["spec_tokens"] / ref["num_prompts"],
            "greedy_outputs_match": ref["greedy_outputs_match"], "dtype": ref["dtype"], "drafter": ref["drafter"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"), help="the demo's pipeline config")
    ap.add_argument("--demo-store", default=str(REPO / "runs"), help="the store holding the finished demo run")
    ap.add_argument("--store", default=str(REPO / "runs" / "estimate-gap"), help="store folder for these runs")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "estimate-gap-cpu.json"))
    ap.add_argument("--long", action="store_true", help="also decode the validation prompts at the traces' length")
    ap.add_argument("--repeat", action="store_true", help="also decode the eval prompts again (determinism)")
    ap.add_argument("--offline", action="store_true", help="also recompute the validation accuracies offline")
    args = ap.parse_args()
    os.chdir(REPO)  # the demo config's paths are relative to the repository root
    base = load_config(args.config)
    demo_root, root = Path(args.demo_store).resolve(), Path(args.store).resolve()
    metrics = json.loads((demo_root / base.run / "train" / "metrics.json").read_text())
    demo_ref = json.loads((demo_root / base.run / "eval" / "reference" / "result.json").read_text())
    n = base.eval.reference.max_prompts or base.eval.max_prompts

    traces = validation_traces(demo_root, base.run, base.train.val_fraction)
    step = max(1, len(traces) // n)  # fewer validation traces than prompts: all of them
    chosen = traces[::step][:n]
    prompts = {json.loads(line)["id"]: line for line in Path(base.traces.prompts).read_text().splitlines() if line.strip()}
    root.mkdir(parents=True, exist_ok=True)
    val_prompts = root / "val_prompts.jsonl"
    val_prompts.write_text("".join(prompts[t["prompt_id"]] + "\n" for t in chosen))

    runs = {"eval-64 (demo)": summarize(demo_ref, base.eval.prompts, n, base.eval.max_new_tokens, None)}
    runs["val-64"] = run_reference(base, "val-64", root, demo_root, str(val_prompts), n, base.eval.max_new_tokens)
    if args.long:
        runs["val-96"] = run_reference(base, "val-96", root, demo_root, str(val_prompts), n,
                                       base.traces.max_new_tokens)
    if args.repeat:
        runs["eval-64 (repeat)"] = run_reference(base, "eval-64", root, demo_root, base.eval.prompts, n,
                                                 base.eval.max_new_tokens)
    val = metrics["final_val"]
    estimate = {"acceptance_length": val["acceptance_length"], "accuracy": val["accuracy"],
                "cumulative": [math.prod(val["accuracy"][:j + 1]) for j in range(len(val["accuracy"]))],
                "tokens": val["tokens"], "val_shards": metrics["val_shards"], "step": val["step"]}
    for r in runs.values():
        r["vs_estimate"] = r["mean_acceptance_length"] / estimate["acceptance_length"]
        r["estimate_formula_on_conditional"] = acceptance_length(r["conditional_acceptance"])
    for name in list(runs):
        if name != "eval-64 (demo)":
            runs[name]["vs_eval_64"] = runs[name]["mean_acceptance_length"] / runs["eval-64 (demo)"]["mean_acceptance_length"]
    lengths = {"validation_traces_all": spread([t["answer_tokens"] for t in traces]),
               "validation_traces_chosen": spread([t["answer_tokens"] for t in chosen]),
               "trace_max_new_tokens": base.traces.max_new_tokens, "eval_max_new_tokens": base.eval.max_new_tokens}
    result = {"hardware": f"{platform.machine()}, {os.cpu_count()}-core CPU", "date": date.today().isoformat(),
              "config": str(args.config), "demo_weights_digest": metrics.get("weights_digest"),
              "estimate": estimate, "chosen_validation_prompts": [t["prompt_id"] for t in chosen],
              "validation_traces": len(traces), "answer_lengths": lengths, "runs": runs}
    if args.offline:
        result["offline"] = offline_validation(base, demo_root, chosen, base.eval.max_new_tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out}")


def print_table(result: dict) -> None:
    e = result["estimate"]
    print(f"{'what':<44} {'tau':>6} {'/est':>6} {'pos1':>6} {'pos2':>6} {'pos3':>6} {'cond2':>6} {'cond3':>6} "
          f"{'ans tok':>7}")
    acc = e["accuracy"]
    print(f"{'estimate (train/metrics.json final_val)':<44} {e['acceptance_length']:>6.3f} {1:>6.3f} "
          + " ".join(f"{c:>6.3f}" for c in e["cumulative"]) + " " + " ".join(f"{a:>6.3f}" for a in acc[1:])
          + f" {'':>7}")
    for name, r in result.get("offline", {}).get("rows", {}).items():
        print(f"offline {name:<36} {r['acceptance_length']:>6.3f} {r['acceptance_length'] / e['acceptance_length']:>6.3f} "
              + " ".join(f"{c:>6.3f}" for c in r["cumulative"]) + " "
              + " ".join(f"{c:>6.3f}" for c in r["conditional"][1:]) + f" {'':>7}")
    for name, r in result["runs"].items():
        print(f"reference decoder {name:<26} {r['mean_acceptance_length']:>6.3f} {r['vs_estimate']:>6.3f} "
              + " ".join(f"{c:>6.3f}" for c in r["per_position_acceptance"]) + " "
              + " ".join(f"{c:>6.3f}" for c in r["conditional_acceptance"][1:]) + f" {r['mean_answer_tokens']:>7.1f}")


def offline_validation(base, demo_root: Path, chosen: list[dict], max_new_tokens: int) -> dict:
    """The trained drafter's TTT unroll (draftline.drafter.ttt.TTTModel, as validation runs it) over the validation
    shards, one sequence at a time, keeping each slot's top-1 hit per step instead of the sums. From the hits:
      per-step    acc_j = hits_j / lossable_j, the validation's own figures (a reproduction check), and the
                  estimate's formula over them;
      chain       1 + the mean number of leading hits per slot (slots with all k steps lossable): the estimate
                  without its assumption that the steps' hits are independent;
      walk        the reference decoder's schedule replayed on the trace (teacher-forced on the trace's tokens):
                  the first draft after the answer's first token, each round accepts its leading hits plus the
                  target's token and the next round drafts from there, up to max_new_tokens answer tokens.
    Each over all validation traces (all answer tokens, as validation counts them) and over the chosen traces'
    first max_new_tokens answer tokens."""
    import torch

    from draftline.drafter.data import read_shard_tensors
    from draftline.drafter.eagle_format import load_eagle_dir
    from draftline.drafter.data import Sequence
    from draftline.drafter.replay import decode_rounds, draft_hits
    from draftline.drafter.train import load_target_head
    from draftline.drafter.ttt import TTTModel

    k, cfg = base.train.ttt_steps, base.train
    target_cfg, embed, head = load_target_head(base.target.path)
    model = load_eagle_dir(demo_root / base.run / "train" / "drafter", embed_tokens=embed.float()).eval()
    ttt = TTTModel(model, head, k, cfg.logits_chunk_tokens, "eager", torch.float32).eval()
    chosen_ids = {t["id"] for t in chosen}
    store = open_store(str(demo_root))
    # name -> (which traces, how many answer tokens of each: None for all)
    sets = {"all validation traces": (lambda tid: True, None),
            f"chosen 32, first {max_new_tokens} answer tokens": (lambda tid: tid in chosen_ids, max_new_tokens)}
    sums = {name: {"hits": [0] * k, "lossable": [0] * k, "chain_slots": 0, "chain_hits": [0] * k, "chain_len": 0,
                   "walk_rounds": 0, "walk_len": 0, "walk_acc": [0] * k} for name in sets}
    from safetensors import safe_open

    with torch.no_grad():
        for part in validation_parts(demo_root, base.run, cfg.val_fraction):
            with safe_open(str(demo_root / part.key), "pt") as f:
                trace_ids = json.loads(f.metadata()["trace_ids"])[part.start:part.stop]
            x = read_shard_tensors(store, part.key)
            cu = x["cu_seqlens"].tolist()[part.start:None if part.stop is None else part.stop + 1]
            for tid, a0, b0 in zip(trace_ids, cu[:-1], cu[1:]):
                b0 = min(b0, a0 + cfg.max_seq_len)
                t = b0 - a0
                if t < 2:
                    continue
                seq = Sequence(x["input_ids"][a0:b0].long(), x["loss_mask"][a0:b0].bool(),
                               x["aux_hidden_states"][a0:b0], x["last_hidden_states"][a0:b0])
                hit, lossable, answer = draft_hits(ttt, seq, torch.device("cpu"))
                lead = torch.cumprod(hit.int(), dim=0).sum(0)  # leading hits per slot [t]
                for name, (included, limit) in sets.items():
                    if not included(tid):
                        continue
                    s = sums[name]
                    for slot in range(t):
                        if limit is not None and slot + 2 >= answer + limit:  # the token step 0 of this slot predicts
                            continue
                        for j in range(k):
                            if lossable[j, slot]:
                                s["lossable"][j] += 1
                                s["hits"][j] += int(hit[j, slot])
                        if bool(lossable[:, slot].all()):
                            s["chain_slots"] += 1
                            s["chain_len"] += 1 + int(lead[slot])
                            for j in range(k):
                                s["chain_hits"][j] += int(lead[slot] > j)
                    for n in decode_rounds(hit, lossable, answer, limit):  # walk: the decoder's own schedule
                        s["walk_rounds"] += 1
                        s["walk_len"] += 1 + n
                        for j in range(n):
                            s["walk_acc"][j] += 1
    rows = {}
    for name, s in sums.items():
        acc = [h / max(1, n) for h, n in zip(s["hits"], s["lossable"])]
        chain_cum = [h / max(1, s["chain_slots"]) for h in s["chain_hits"]]
        rows[f"per-step: {name}"] = {
            "acceptance_length": acceptance_length(acc), "accuracy": acc,
            "cumulative": [math.prod(acc[:j + 1]) for j in range(k)], "conditional": acc, "lossable": s["lossable"]}
        rows[f"chain: {name}"] = {
            "acceptance_length": s["chain_len"] / max(1, s["chain_slots"]), "cumulative": chain_cum,
            "conditional": [chain_cum[0]] + [chain_cum[j] / chain_cum[j - 1] if chain_cum[j - 1] else float("nan")
                                             for j in range(1, k)],
            "slots": s["chain_slots"]}
        walk_cum = [c / max(1, s["walk_rounds"]) for c in s["walk_acc"]]
        rows[f"walk: {name}"] = {
            "acceptance_length": s["walk_len"] / max(1, s["walk_rounds"]), "rounds": s["walk_rounds"],
            "cumulative": walk_cum,
            "conditional": [walk_cum[0]] + [walk_cum[j] / walk_cum[j - 1] if walk_cum[j - 1] else float("nan")
                                            for j in range(1, k)]}
    return {"rows": rows}


if __name__ == "__main__":
    main()
