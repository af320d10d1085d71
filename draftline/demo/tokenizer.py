"""The demo tokenizer: byte-level BPE (vocab 4096) trained on the corpus, saved as a transformers fast tokenizer with a chat template."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 4096
BOS, EOS, PAD = "<|bos|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS]

# A turn ends with the eos token, so a chat answer stops where a raw document would. No newline follows a
# role tag: a generation prompt must end on a special token, or BPE merges "\n" with the answer's first
# indentation in training but not in the prompt, and the model never sees the prompt's last token there.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('chat roles must be system, user or assistant, not ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def train_tokenizer(texts, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Raw prompts get a bos like training documents; chat prompts get theirs from the template instead.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def chat_text(user: str, assistant: str | None = None) -> str:
    """The chat template written out by hand (the same string the jinja template renders), for building training data."""
    text = f"{BOS}<|user|>{user}{EOS}\n<|assistant|>"
    return text if assistant is None else text + assistant + EOS


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int = 2048) -> None:
    """Write tokenizer.json plus the transformers config files (no transformers import needed)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS), "pad_token_id": tok.token_to_id(PAD)}


def grow_tokenizer(source: Path, out: Path, tokens: list[str], special: bool, chat_template: str) -> dict[str, int]:
    """A demo target's tokenizer folder (tokenizer.json, tokenizer_config.json, special_tokens_map.json) written to
    `out` as the one in `source` plus `tokens` at the ids after its vocabulary, with `chat_template`; returns the ids."""
    from tokenizers import AddedToken

    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    base = tok.get_vocab_size()
    added = [AddedToken(t, special=special, normalized=False) for t in tokens]
    if special:
        tok.add_special_tokens(added)
    else:
        tok.add_tokens(added)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in tokens}
    assert sorted(ids.values()) == list(range(base, base + len(ids))), ids
    config = json.loads((source / "tokenizer_config.json").read_text())
    for t, i in ids.items():
        config["added_tokens_decoder"][str(i)] = {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                                  "single_word": False, "special": special}
    config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text((source / "special_tokens_map.json").read_text())
    return ids
