"""Prompt sets from held-out modules: a function's signature and docstring, as a raw prompt and as a chat message."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from draftline.demo.corpus import DocumentedFunction, ModuleSource, documented_functions

MAX_HEAD_CHARS = 1000


def prompt_id(fn: DocumentedFunction) -> str:
    return f"{fn.module}:{fn.qualname}"


def chat_user_text(fn: DocumentedFunction) -> str:
    """What the user says in the chat variant; training chat examples use the same text."""
    return fn.head.rstrip("\n")


def raw_prompt_text(fn: DocumentedFunction) -> str:
    """The raw prompt stops before the docstring's newline, which BPE merges with the body's first indentation."""
    return fn.head.rstrip("\n")


def candidate_functions(held_out: list[ModuleSource]) -> list[DocumentedFunction]:
    """Documented functions of held-out library (non-test) modules, one per id, in a stable hash order."""
    seen, out = set(), []
    for module in held_out:
        if module.is_test:
            continue
        for fn in documented_functions(module):
            if len(fn.head) <= MAX_HEAD_CHARS and prompt_id(fn) not in seen:
                seen.add(prompt_id(fn))
                out.append(fn)
    return sorted(out, key=lambda f: hashlib.sha256(prompt_id(f).encode()).hexdigest())


def split_prompts(fns: list[DocumentedFunction], n_eval: int, n_train: int):
    """(train, eval, spare): the first n_eval functions evaluate, the next n_train train, the rest are spare prompts
    for benchmarks that need more unseen prompts than the eval set has."""
    if len(fns) < n_eval + 1:
        raise ValueError(f"only {len(fns)} held-out functions; lower the eval prompt count below {len(fns)}")
    return fns[n_eval:n_eval + n_train], fns[:n_eval], fns[n_eval + n_train:]


def write_prompt_sets(out_dir: Path, train: list[DocumentedFunction], evaluation: list[DocumentedFunction],
                      spare: list[DocumentedFunction]) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, fns in (("train", train), ("eval", evaluation), ("spare", spare)):
        chat = [{"id": prompt_id(f), "messages": [{"role": "user", "content": chat_user_text(f)}]} for f in fns]
        raw = [{"id": prompt_id(f), "prompt": raw_prompt_text(f)} for f in fns]
        for name, rows in ((f"{split}_prompts.jsonl", chat), (f"{split}_prompts_raw.jsonl", raw)):
            (out_dir / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        counts[split] = len(fns)
    return counts
