"""Fine-tune demo-llama into demo-thinking on the corpus's function examples, each answered after a thinking block.

  python -m draftline.demo.train_thinking [--seconds 480] [--steps N]   (CPU, one thread; then commit the result)

The thinking block is learnable from the prompt alone: it restates the function's name, its arguments and its
docstring's first line in a fixed phrasing (`thought`), then `</think>` and the body, as demo-llama answers. A
third of the examples are rendered with `thinking: false` (an empty block), so the target answers in both modes.
Only the last decoder layers, the final norm, the LM head and the two new embedding rows learn; the rest is
demo-llama's, which is what lets draftline.demo.thinking keep only those tensors in git. Writes TUNED_FILE and
then every file of assets/demo-thinking (training.json records this run's settings and metrics).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import time
from pathlib import Path

import torch

from draftline.demo import corpus
from draftline.demo import thinking as demo_thinking
from draftline.demo.corpus import DocumentedFunction

MAX_FIRST_LINE = 120
THINKING_OFF_PERCENT = 33


def signature(fn: DocumentedFunction) -> tuple[str, list[str], str] | None:
    """(name, argument names, the docstring's first line) of a function example; None if its head does not parse."""
    try:
        node = ast.parse(fn.head).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args]
    names += [f"*{a.vararg.arg}"] if a.vararg else (["*"] if a.kwonlyargs else [])
    names += [x.arg for x in a.kwonlyargs] + ([f"**{a.kwarg.arg}"] if a.kwarg else [])
    doc = (ast.get_docstring(node) or "").strip()
    first = doc.splitlines()[0].strip() if doc else ""
    if len(first) > MAX_FIRST_LINE:
        first = first[:MAX_FIRST_LINE].rsplit(" ", 1)[0]
    return node.name, names, first


def thought(fn: DocumentedFunction) -> str | None:
    """The thinking block's text for a function prompt, in a fixed phrasing; None if the head does not parse."""
    sig = signature(fn)
    if sig is None:
        return None
    name, args, first = sig
    takes = ", ".join(args) if args else "no arguments"
    return f"The user wants the body of {name}.\nIt takes {takes}.\nThe docstring says: {first}\nNow the code."


def thinks(fn: DocumentedFunction) -> bool:
    """Whether a training example is rendered in thinking mode (two in three, fixed by the function's name)."""
    return not corpus.is_held_out("thinking:" + fn.module + fn.qualname, THINKING_OFF_PERCENT)


def example_text(fn: DocumentedFunction, think: bool) -> tuple[str, str] | None:
    """(prompt, answer) of one example as demo-thinking's template writes them; None if the head does not parse."""
    from draftline.demo.prompts import chat_user_text

    t = thought(fn)
    if t is None:
        return None
    prompt = f"<|bos|><|user|>{chat_user_text(fn)}<|end|>\n<|assistant|><think>"
    if think:
        return prompt, f"{t}</think>{fn.body}<|end|>"
    return prompt + "</think>", f"{fn.body}<|end|>"


def encode_examples(tok, fns: list[DocumentedFunction], max_len: int) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask over the answer) per example, at most max_len tokens each."""
    out = []
    for fn in fns:
        pair = example_text(fn, thinks(fn))
        if pair is None:
            continue
        p = tok(pair[0], add_special_tokens=False)["input_ids"]
        a = tok(pair[1], add_special_tokens=False)["input_ids"]
        ids, mask = (p + a)[:max_len], ([0] * len(p) + [1] * len(a))[:max_len]
        if sum(mask):
            out.append((ids, mask))
    return out


def packed_rows(examples, row_len: int, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """Examples in random order, concatenated into rows of row_len tokens (demo-llama trained on such streams)."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    rows, ids, mask = [], [], []
    for i in order:
        e_ids, e_mask = examples[i]
        if len(ids) + len(e_ids) > row_len and ids:
            rows.append((ids + [0] * (row_len - len(ids)), mask + [0] * (row_len - len(mask))))
            ids, mask = [], []
        ids, mask = ids + e_ids, mask + e_mask
    if ids:
        rows.append((ids + [0] * (row_len - len(ids)), mask + [0] * (row_len - len(mask))))
    return rows


def masked_loss(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    m = mask[:, 1:].flatten().float()
    return (loss * m).sum() / m.sum().clamp(min=1)


def trainable(model, base_vocab: int) -> list[torch.nn.Parameter]:
    """Freeze what stays demo-llama's; the embedding learns only its new rows (its other rows' gradients are zeroed)."""
    params = []
    for name, p in model.named_parameters():
        p.requires_grad = demo_thinking.is_tuned(name) or name == "model.embed_tokens.weight"
        if p.requires_grad:
            params.append(p)
    embed = model.model.embed_tokens.weight
    keep = torch.zeros_like(embed)
    keep[base_vocab:] = 1
    embed.register_hook(lambda g: g * keep)
    return params


def init_new_rows(model, base_vocab: int) -> None:
    """The thinking tokens start from the mean embedding and LM-head row (no preference among the old tokens)."""
    with torch.no_grad():
        for w in (model.model.embed_tokens.weight, model.lm_head.weight):
            w[base_vocab:] = w[:base_vocab].mean(0, keepdim=True)


@torch.no_grad()
def greedy_check(model, tok, fns: list[DocumentedFunction], new_tokens: int, batch: int = 16) -> dict:
    """Greedy answers to held-out prompts in thinking mode: how many close the block, write the expected thought
    exactly, and go on to a body that starts like Python code."""
    model.eval()
    closed = exact = coded = 0
    lines_right = [0, 0, 0]  # the block's name, arguments and docstring lines, each as expected
    samples = []
    for start in range(0, len(fns), batch):
        group = fns[start:start + batch]
        prompts = [tok(example_text(f, True)[0], add_special_tokens=False)["input_ids"] for f in group]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=tok.eos_token_id)
        for f, row in zip(group, out[:, width:].tolist()):
            text = tok.decode(row, skip_special_tokens=False)
            head, sep, body = text.partition(demo_thinking.THINK_CLOSE)
            closed += bool(sep)
            exact += bool(sep) and head == thought(f)
            for i, (got, want) in enumerate(zip(head.split("\n"), thought(f).split("\n")[:3])):
                lines_right[i] += bool(sep) and got == want
            coded += bool(sep) and body.startswith("    ")
            if len(samples) < 3:
                samples.append({"id": f"{f.module}:{f.qualname}", "answer": text})
    model.train()
    n = len(fns)
    return {"prompts": n, "new_tokens": new_tokens, "closed_the_block": closed / n, "exact_thought": exact / n,
            "name_line_right": lines_right[0] / n, "arguments_line_right": lines_right[1] / n,
            "docstring_line_right": lines_right[2] / n, "body_indented_after_block": coded / n, "samples": samples}


def train(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftline.demo.prompts import candidate_functions

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out, source = Path(args.out), Path(args.source)
    out.mkdir(parents=True, exist_ok=True)
    demo_thinking.build_tokenizer(source, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    modules = corpus.stdlib_modules()
    train_mods, held_mods = corpus.split_modules(modules)
    train_fns = [f for m in train_mods for f in corpus.documented_functions(m)]
    held_fns = candidate_functions(held_mods)[:args.check_prompts]  # the eval prompts' functions, in their order
    examples = encode_examples(tok, train_fns, args.max_len)

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    base_vocab = model.config.vocab_size
    model.resize_token_embeddings(base_vocab + len(demo_thinking.THINK_TOKENS), mean_resizing=False)
    init_new_rows(model, base_vocab)
    params = trainable(model, base_vocab)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rows = packed_rows(examples, args.row_len, rng)
    steps = args.steps or 10**9
    t0, curve, step, losses = time.time(), [], 0, []
    while step < steps:
        for start in range(0, len(rows) - args.batch + 1, args.batch):
            if step == 20 and not args.steps:  # time 20 steps, then fix the count to the budget
                steps = max(40, int(args.seconds / ((time.time() - t0) / 20)))
                print(f"{(time.time() - t0) / 20:.2f} s/step -> {steps} steps", flush=True)
            if step >= steps:
                break
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
            for g in opt.param_groups:
                g["lr"] = lr
            chunk = rows[start:start + args.batch]
            ids = torch.tensor([r[0] for r in chunk])
            mask = torch.tensor([r[1] for r in chunk])
            loss = masked_loss(model, ids, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(loss.item())
            step += 1
            if step % 50 == 0 or step == steps:
                curve.append({"step": step, "loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
                              "seconds": round(time.time() - t0, 1)})
                print(f"step {step}/{steps} loss {curve[-1]['loss']:.3f} ({curve[-1]['seconds']:.0f} s)", flush=True)
        else:
            rows = packed_rows(examples, args.row_len, rng)  # another pass, in another order
    wall = time.time() - t0
    from safetensors.torch import save_file

    tuned = demo_thinking.tuned_tensors(model.state_dict(), base_vocab)
    (out / demo_thinking.TUNED_FILE).parent.mkdir(exist_ok=True)
    save_file(tuned, str(out / demo_thinking.TUNED_FILE), metadata={"format": "pt"})
    shipped = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    shipped.resize_token_embeddings(base_vocab + len(demo_thinking.THINK_TOKENS), mean_resizing=False)
    state = demo_thinking.assemble(source, out / demo_thinking.TUNED_FILE)
    shipped.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    check = greedy_check(shipped.eval(), tok, held_fns, args.check_tokens)
    print(json.dumps({k: v for k, v in check.items() if k != "samples"}), flush=True)
    import transformers

    metrics = {
        "corpus": {"python": corpus.python_version(), "fingerprint": corpus.corpus_fingerprint(modules),
                   "train_functions": len(train_fns), "examples": len(examples),
                   "thinking_off_share": round(sum(not thinks(f) for f in train_fns) / len(train_fns), 3),
                   "example_tokens": sum(len(e[0]) for e in examples),
                   "examples_sha256": hashlib.sha256(json.dumps(examples).encode()).hexdigest()},
        "training": {k: v for k, v in vars(args).items() if k not in ("out", "source")} | {"steps": step},
        "trained": ["model.layers.%d.*" % i for i in demo_thinking.TUNED_LAYERS]
        + ["model.norm.weight", "lm_head.weight", "model.embed_tokens.weight rows of <think>, </think>"],
        "tokens_seen": step * args.batch * args.row_len,
        "final_loss": curve[-1]["loss"] if curve else None,
        "wall_seconds": round(wall, 1), "device": "cpu", "torch_threads": args.threads,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "held_out_greedy_check": check, "curve": curve,
    }
    demo_thinking.build(source, out, training=metrics)
    return metrics


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default=str(demo_thinking.SOURCE))
    p.add_argument("--out", default=str(demo_thinking.OUT))
    p.add_argument("--seconds", type=float, default=480.0, help="time budget; sets --steps after timing 20 steps")
    p.add_argument("--steps", type=int, default=None, help="fixed step count (reruns of a recorded training)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--batch", type=int, default=4, help="rows per step")
    p.add_argument("--row-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=256, help="longest example in tokens")
    p.add_argument("--check-prompts", type=int, default=64, help="held-out prompts of the greedy check")
    p.add_argument("--check-tokens", type=int, default=96)
    return p.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
