"""Rebuild the demo assets: `data` (corpus, tokenizer, token streams, prompt sets), `train`, and `package` (checkpoints under assets/).

  python -m draftline.demo.build data    [--work .gpu/data] [--assets assets]
  python -m draftline.demo.build train   [--work .gpu/data] [--trained .gpu/trained] [--seconds 300] [--steps demo-llama=N]
  python -m draftline.demo.build package [--work .gpu/data] [--trained .gpu/trained] [--assets assets]
  python -m draftline.demo.build samples [--assets assets]   (greedy samples and CPU tokens/s, for assets/README.md)

`train` runs draftline.demo.train_targets for both targets (on a GPU in minutes, on a CPU in many hours).
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

from draftline.demo import corpus as corpus_mod
from draftline.demo.models import TARGET_NAMES

N_EVAL_PROMPTS, N_TRAIN_PROMPTS = 64, 400


def build_data(work: Path, assets: Path, seed: int = 0) -> dict:
    import numpy as np

    from draftline.demo.prompts import candidate_functions, chat_user_text, split_prompts, write_prompt_sets
    from draftline.demo.tokenizer import BOS, EOS, chat_text, save_tokenizer, special_ids, train_tokenizer

    modules = corpus_mod.stdlib_modules()
    train_mods, held_mods = corpus_mod.split_modules(modules)
    tok = train_tokenizer(m.text for m in train_mods)  # tokenizer sees only the train split
    save_tokenizer(tok, work / "tokenizer")
    ids = special_ids(tok)
    bos, eos = ids["bos_token_id"], ids["eos_token_id"]

    def docs(texts):
        return [[bos, *e.ids, eos] for e in tok.encode_batch(list(texts), add_special_tokens=False)]

    def chats(fns):
        texts = [chat_text(chat_user_text(f), f.body) for f in fns]
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    train_fns = [f for m in train_mods for f in corpus_mod.documented_functions(m)]
    held_fns = candidate_functions(held_mods)
    # Half of the train split's documented functions become chat turns, half standalone raw documents, so both
    # prompt paths (chat and raw "signature + docstring") are trained on held-in code only.
    as_chat = [f for f in train_fns if corpus_mod.is_held_out("chat:" + f.module + f.qualname, 50)]
    as_raw = [f for f in train_fns if not corpus_mod.is_held_out("chat:" + f.module + f.qualname, 50)]
    train_docs = docs(m.text for m in train_mods) + chats(as_chat) + docs(f.head + f.body for f in as_raw)
    random.Random(seed).shuffle(train_docs)

    def stream(seqs):
        return np.fromiter((t for s in seqs for t in s), dtype=np.uint16)

    work.mkdir(parents=True, exist_ok=True)
    streams = {"train": stream(train_docs), "heldout": stream(docs(m.text for m in held_mods)),
               "heldout_chat": stream(chats(held_fns))}
    for name, arr in streams.items():
        np.save(work / f"{name}.npy", arr)
    counts = write_prompt_sets(assets / "prompts", *split_prompts(held_fns, N_EVAL_PROMPTS, N_TRAIN_PROMPTS))
    meta = {
        "python": corpus_mod.python_version(),
        "corpus_fingerprint": corpus_mod.corpus_fingerprint(modules),
        "modules": {"train": len(train_mods), "held_out": len(held_mods)},
        "held_out_modules": [m.name for m in held_mods],
        "chat_examples_in_train": len(as_chat),
        "function_documents_in_train": len(as_raw),
        "tokens": {k: int(len(v)) for k, v in streams.items()},
        "special_ids": ids,
        "bos": BOS, "eos": EOS,
        "prompts": counts,
        "seed": seed,
    }
    (work / "data.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def run_training(work: Path, trained: Path, seconds: float, steps: dict[str, int] | None = None) -> None:
    procs = []
    for name in TARGET_NAMES:
        cmd = [sys.executable, "-m", "draftline.demo.train_targets", "--data", str(work), "--target", name,
               "--out", str(trained)]
        cmd += ["--steps", str(steps[name])] if steps and name in steps else ["--seconds", str(seconds)]
        procs.append(subprocess.Popen(cmd))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"training failed with exit codes {codes}")


def greedy_samples_and_speed(assets: Path, n_samples: int = 2, new_tokens: int = 48) -> dict:
    """Greedy answers to the first eval prompts (raw and chat) and CPU decode speed, per target (transformers, fp32)."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    raw = [json.loads(x) for x in (assets / "prompts" / "eval_prompts_raw.jsonl").read_text().splitlines()]
    chat = [json.loads(x) for x in (assets / "prompts" / "eval_prompts.jsonl").read_text().splitlines()]
    report = {}
    for name in TARGET_NAMES:
        tok = AutoTokenizer.from_pretrained(str(assets / name))
        model = AutoModelForCausalLM.from_pretrained(str(assets / name), dtype=torch.float32).eval()
        samples = []
        for row, kind in [(r, "raw") for r in raw[:n_samples]] + [(c, "chat") for c in chat[:n_samples]]:
            if kind == "raw":
                ids = tok(row["prompt"], return_tensors="pt")["input_ids"]
            else:
                ids = tok.apply_chat_template(row["messages"], add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:]
            samples.append({"id": row["id"], "kind": kind, "prompt": row.get("prompt") or row["messages"][0]["content"],
                            "completion": tok.decode(out)})
        # Decode speed: batch 1, 64 new tokens with eos ignored, after one warm-up call.
        ids = tok(raw[0]["prompt"], return_tensors="pt")["input_ids"]
        model.generate(ids, max_new_tokens=8, do_sample=False)
        speed = {}
        for dtype in (torch.float32, torch.bfloat16):
            model.to(dtype)
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
            speed[str(dtype).split(".")[-1]] = round((out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0), 1)
        report[name] = {"samples": samples, "cpu_tokens_per_s": speed, "torch_threads": torch.get_num_threads()}
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=["data", "train", "package", "samples"])
    p.add_argument("--work", default=".gpu/data")
    p.add_argument("--trained", default=".gpu/trained")
    p.add_argument("--assets", default="assets")
    p.add_argument("--seconds", type=float, default=300.0, help="training time budget per target")
    p.add_argument("--steps", action="append", default=[], metavar="TARGET=N",
                   help="fixed step count for one target instead of the time budget (repeatable)")
    args = p.parse_args(argv)
    work, assets, trained = Path(args.work), Path(args.assets), Path(args.trained)
    if args.step == "data":
        meta = build_data(work, assets)
        print(json.dumps({k: v for k, v in meta.items() if k != "held_out_modules"}, indent=1))
    elif args.step == "train":
        steps = dict(item.split("=", 1) for item in args.steps)
        run_training(work, trained, args.seconds, {k: int(v) for k, v in steps.items()})
    elif args.step == "samples":
        print(json.dumps(greedy_samples_and_speed(assets), indent=1))
    else:
        from draftline.demo.package import package_all

        package_all(work, trained, assets)


if __name__ == "__main__":
    main()
