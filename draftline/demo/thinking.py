"""Build assets/demo-thinking: demo-llama taught to think before it answers, assembled from demo-llama's weights.

  python -m draftline.demo.thinking [--check | --rebuild]

demo-thinking writes a thinking block, `<think>...</think>`, before its answer, as reasoning models do (DeepSeek-R1,
Qwen3, Kimi-K2-Thinking), so that thinking mode can be tested end to end on a CPU: the chat template opens `<think>`
after the assistant tag unless it is rendered with `thinking: false` (then it writes an empty `<think></think>`), and
vLLM's `--reasoning-parser deepseek_r1` splits the answer into reasoning and content.

Its weights are demo-llama's with two vocabulary rows added for `<think>` and `</think>` and its last decoder layers,
final norm and LM head fine-tuned (draftline.demo.train_thinking). Only the fine-tuned tensors are kept in git
(TUNED_FILE, a few MB); this module assembles model.safetensors from them and demo-llama's file, by concatenation
and replacement only (no arithmetic), so every machine derives the same bytes: SHA256SUMS pins them, and
`make venv` runs this module.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftline.demo.package import asset_main, sha256_file, sha256_mismatches
from draftline.demo.tokenizer import grow_tokenizer

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "assets" / "demo-llama"
OUT = REPO / "assets" / "demo-thinking"

MODEL_FILE = "model.safetensors"  # assembled here, not in git
# The fine-tuned tensors, in git; in a folder of their own, since engines load every *.safetensors beside config.json.
TUNED_FILE = "tuned/thinking-tensors.safetensors"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
THINK_TOKENS = (THINK_OPEN, THINK_CLOSE)
# The decoder layers fine-tuned (the last two of demo-llama's eight); every other layer is demo-llama's.
TUNED_LAYERS = (6, 7)
# The parser of vLLM that splits this target's answers: it expects the template to open the block itself.
REASONING_PARSER = "deepseek_r1"

# The demo's turns (draftline.demo.tokenizer), with the assistant's turn written as `<think>reasoning</think>answer`.
# An earlier answer that carries its thinking inline (`reasoning</think>answer`, as the model wrote it after the
# generation prompt's `<think>`) is split at `</think>`, so a conversation's prompts continue one another.
# No newline follows a tag, for the reason the demo's template gives (byte-level BPE merges it with the answer).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set thinking = thinking if thinking is defined else true -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('chat roles must be system, user or assistant, not ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- set content = message['content'] if message['content'] is string else '' -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set reasoning = message['reasoning_content'] if message['reasoning_content'] is string else '' -%}"
    "{%- if not reasoning and '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{{- '<|assistant|><think>' + reasoning + '</think>' + content + '<|end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|' + message['role'] + '|>' + content + '<|end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|assistant|><think>' if thinking else '<|assistant|><think></think>' -}}"
    "{%- endif -%}"
)


def build_tokenizer(source: Path, out: Path) -> dict[str, int]:
    """demo-llama's tokenizer plus `<think>` and `</think>` (ids after the demo's 4096) and the thinking template.

    The two are added tokens, matched whole in text, but not special ones: vLLM's reasoning parsers find them in the
    vocabulary by their text and look for `</think>` in the decoded answer, which a decode that skips special tokens
    (vLLM's default) would drop."""
    return grow_tokenizer(source, out, THINK_TOKENS, False, CHAT_TEMPLATE)


def vocab_size(source: Path = SOURCE) -> int:
    return json.loads((source / "config.json").read_text())["vocab_size"] + len(THINK_TOKENS)


def is_tuned(key: str) -> bool:
    """The tensors fine-tuned for thinking (TUNED_FILE holds them, the new embedding rows aside)."""
    return (key in ("model.norm.weight", "lm_head.weight")
            or any(key.startswith(f"model.layers.{i}.") for i in TUNED_LAYERS))


def assemble(source: Path, tuned_file: Path) -> dict[str, torch.Tensor]:
    """demo-llama's tensors with the embedding grown by the thinking tokens' rows and the tuned tensors in place."""
    with safe_open(str(tuned_file), "pt") as f:
        tuned = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    with safe_open(str(source / MODEL_FILE), "pt") as f:
        for key in f.keys():
            if key == "model.embed_tokens.weight":
                out[key] = torch.cat([f.get_tensor(key), tuned["think_embed_rows"]]).contiguous()
            elif is_tuned(key):
                out[key] = tuned[key]
            else:
                out[key] = f.get_tensor(key)
    return out


def tuned_tensors(state: dict[str, torch.Tensor], base_vocab: int) -> dict[str, torch.Tensor]:
    """What TUNED_FILE keeps of a fine-tuned state dict: the tuned tensors and the new embedding rows, in bf16."""
    kept = {k: v for k, v in state.items() if is_tuned(k)}
    kept["think_embed_rows"] = state["model.embed_tokens.weight"][base_vocab:]
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in kept.items()}


def write_sha256sums(out: Path) -> None:
    """SHA256SUMS over the checkpoint's files and the tuned tensors' file."""
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != "SHA256SUMS") + [out / TUNED_FILE]
    (out / "SHA256SUMS").write_text("".join(f"{sha256_file(p)}  {p.relative_to(out).as_posix()}\n" for p in files))


def write_model_file(source: Path, out: Path) -> None:
    save_file(assemble(source, out / TUNED_FILE), str(out / MODEL_FILE), metadata={"format": "pt"})


def build(source: Path = SOURCE, out: Path = OUT, training: dict | None = None) -> Path:
    """Write every file of demo-thinking from demo-llama and TUNED_FILE (already in `out`); training: the
    fine-tuning record for training.json (None: keep the one there)."""
    out.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(source, out)
    config = json.loads((source / "config.json").read_text())
    config["vocab_size"] = vocab_size(source)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text((source / "generation_config.json").read_text())
    if training is not None:
        lineage = {"name": "demo-thinking",
                   "built_by": "python -m draftline.demo.train_thinking (draftline/demo/train_thinking.py), "
                               "assembled by python -m draftline.demo.thinking",
                   "from": {"target": "demo-llama", "sha256": sha256_file(source / MODEL_FILE)},
                   "think_token_ids": ids, "tuned": {"layers": list(TUNED_LAYERS), "file": TUNED_FILE,
                                                     "also": ["model.norm.weight", "lm_head.weight",
                                                              "the two new rows of model.embed_tokens.weight"]},
                   "reasoning_parser": REASONING_PARSER, "training": training}
        (out / "training.json").write_text(json.dumps(lineage, indent=1) + "\n")
    write_model_file(source, out)
    write_sha256sums(out)
    return out


def mismatches(out: Path = OUT) -> list[str]:
    """Files of demo-thinking that are missing or differ from SHA256SUMS."""
    return sha256_mismatches(out)


def ensure(source: Path = SOURCE, out: Path = OUT) -> Path:
    """Assemble model.safetensors when it is missing; refuse when the result is not the pinned one."""
    if mismatches(out) == [MODEL_FILE]:
        write_model_file(source, out)
    bad = mismatches(out)
    if bad:
        raise SystemExit(f"assets/demo-thinking: {', '.join(bad)} differ from SHA256SUMS; rebuild with "
                         "`python -m draftline.demo.thinking --rebuild` and commit the result")
    return out


def main(argv: list[str] | None = None) -> int:
    return asset_main("demo-thinking", OUT, build, ensure, "write every file again from demo-llama and the committed "
                      "fine-tuned tensors (after demo-llama's tokenizer or config changed)", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
