"""Build assets/demo-kimi: a Kimi-K2.5 (KimiK25ForConditionalGeneration) whose language model is demo-deepseek's.

  python -m draftline.demo.kimi [--check]     (writes what is missing or stale; --check only verifies)

The checkpoint is laid out like moonshotai's Kimi-K2.5 on disk, which is the layout both transformers (through its
conversion mapping) and vLLM (natively) read: `language_model.model.layers.*` and `language_model.lm_head.weight`
for the DeepSeek-V3 text model, `vision_tower.encoder.blocks.*` with a fused `wqkv` for the MoonViT tower, and
`mm_projector.proj.{0,2}` for the projector. The language model's tensors are demo-deepseek's trained tensors under
those names, with the vocabulary grown by Kimi's media tokens; the vision tower is tiny, trained by
draftline.demo.kimi_vision to describe the demo's images (a rebuild keeps its tensors; seeded-random before that).

The language-model file (16 MB) is derived here rather than kept in git, so assets/ stays within 40 MB in the
repository: `make venv` runs this module, and SHA256SUMS pins the derived bytes, so every machine gets the same file.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftline.demo.package import asset_main, sha256_file, sha256_mismatches, write_sha256sums
from draftline.demo.tokenizer import CHAT_TEMPLATE as DEMO_CHAT_TEMPLATE, grow_tokenizer

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "assets" / "demo-deepseek"
OUT = REPO / "assets" / "demo-kimi"

LANGUAGE_FILE = "model-language.safetensors"  # derived from demo-deepseek, not in git
VISION_FILE = "model-vision.safetensors"
# Kimi-K2.5's media tokens, then reserved ones up to a multiple of 8 (the real vocabulary is padded the same way).
MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
                "<|kimi_k25_video_placeholder|>")
RESERVED_TOKENS = ("<|reserved_token_0|>", "<|reserved_token_1|>", "<|reserved_token_2|>")
MEDIA_PLACEHOLDER = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
# MoonViT at its smallest: one block of width 32; patches of 14 as in Kimi-K2.5, merged 2 x 2 before the projector.
VISION = dict(patch_size=14, pos_emb_height=4, pos_emb_width=4, pos_emb_time=4, num_attention_heads=2,
              num_hidden_layers=1, hidden_size=32, intermediate_size=64, merge_kernel_size=[2, 2],
              hidden_act="gelu_pytorch_tanh")
VISION_SEED = 0
# The demo's chat format (what demo-deepseek was trained on), taught to render image parts as Kimi's placeholder:
# its one text turn becomes a turn whose content may be a list of text and image parts.
_TEXT_TURN = "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>\\n' -}}"
_MEDIA_TURN = (
    "{{- '<|' + message['role'] + '|>' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ['image', 'image_url'] -%}{{- '" + MEDIA_PLACEHOLDER + "' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|end|>\\n' -}}"
)
assert _TEXT_TURN in DEMO_CHAT_TEMPLATE
CHAT_TEMPLATE = DEMO_CHAT_TEMPLATE.replace(_TEXT_TURN, _MEDIA_TURN)
# MoonViT's image preprocessing (vLLM's Kimi-K2.5 processor reads `media_proc_cfg`), with a small patch budget.
PREPROCESSOR = {"media_proc_cfg": {
    "in_patch_limit": 256, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 64,
    "in_patch_limit_each_frame": 256, "in_patch_limit_video": None, "sample_fps": 2.0,
    "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff"}}


def source_config(source: Path) -> dict:
    return json.loads((source / "config.json").read_text())


def text_config(source: Path, vocab_size: int) -> dict:
    text = {k: v for k, v in source_config(source).items() if k not in ("architectures", "transformers_version", "dtype")}
    text["vocab_size"] = vocab_size
    return text


def build_tokenizer(source: Path, out: Path) -> dict[str, int]:
    """demo-deepseek's tokenizer plus Kimi's media tokens (ids after the demo's 4096); returns their ids."""
    return grow_tokenizer(source, out, MEDIA_TOKENS + RESERVED_TOKENS, True, CHAT_TEMPLATE)


def kimi_config(source: Path, ids: dict[str, int], vocab_size: int) -> dict:
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text_config(source, vocab_size),
        "vision_config": {"model_type": "kimi_k25_vision", **VISION},
        "projection_hidden_size": VISION["hidden_size"],
        "projection_layer_norm_eps": 1e-5,
        "image_token_id": ids["<|media_pad|>"],
        # Kimi-K2.5's own config.json carries it; vLLM reads it when it attaches an EAGLE-3 drafter to this class.
        "media_placeholder_token_id": ids["<|media_pad|>"],
        # vLLM routes image and video parts to this class's one modality (vision_chunk) only where the config says so,
        # as Kimi-K2.5's does; without it vLLM's chat API takes no image ("At most 0 image(s) may be provided").
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "video_token_id": ids["<|kimi_k25_video_placeholder|>"],
        "vision_start_token_id": ids["<|media_begin|>"],
        "vision_end_token_id": ids["<|media_end|>"],
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "bos_token_id": source_config(source)["bos_token_id"],
        "eos_token_id": source_config(source)["eos_token_id"],
        "pad_token_id": source_config(source)["pad_token_id"],
    }


def language_tensors(source: Path, vocab_size: int) -> dict[str, torch.Tensor]:
    """demo-deepseek's tensors under Kimi's names; the new vocabulary rows are zeros (text never holds those tokens,
    and zeros need no arithmetic, so every machine derives the same bytes)."""
    out = {}
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            if key in ("model.embed_tokens.weight", "lm_head.weight"):
                t = torch.cat([t, t.new_zeros(vocab_size - t.shape[0], t.shape[1])]).contiguous()
            out[f"language_model.{key}"] = t
    return out


def vision_tensors(text_hidden: int) -> dict[str, torch.Tensor]:
    """A seeded MoonViT tower and projector with the key names and shapes of Kimi-K2.5's checkpoint."""
    g = torch.Generator().manual_seed(VISION_SEED)
    d, i, p = VISION["hidden_size"], VISION["intermediate_size"], VISION["patch_size"]
    merged = d * VISION["merge_kernel_size"][0] * VISION["merge_kernel_size"][1]

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    t = {"vision_tower.patch_embed.proj.weight": rand(d, 3, p, p), "vision_tower.patch_embed.proj.bias": rand(d),
         "vision_tower.patch_embed.pos_emb.weight": rand(VISION["pos_emb_height"], VISION["pos_emb_width"], d)}
    for b in range(VISION["num_hidden_layers"]):
        pre = f"vision_tower.encoder.blocks.{b}"
        for norm in ("norm0", "norm1"):
            t[f"{pre}.{norm}.weight"] = torch.ones(d, dtype=torch.bfloat16)
            t[f"{pre}.{norm}.bias"] = torch.zeros(d, dtype=torch.bfloat16)
        t.update({f"{pre}.wqkv.weight": rand(3 * d, d), f"{pre}.wqkv.bias": rand(3 * d),
                  f"{pre}.wo.weight": rand(d, d), f"{pre}.wo.bias": rand(d),
                  f"{pre}.mlp.fc0.weight": rand(i, d), f"{pre}.mlp.fc0.bias": rand(i),
                  f"{pre}.mlp.fc1.weight": rand(d, i), f"{pre}.mlp.fc1.bias": rand(d)})
    t.update({"vision_tower.encoder.final_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
              "vision_tower.encoder.final_layernorm.bias": torch.zeros(d, dtype=torch.bfloat16),
              "mm_projector.pre_norm.weight": torch.ones(d, dtype=torch.bfloat16),
              "mm_projector.pre_norm.bias": torch.zeros(d, dtype=torch.bfloat16),
              "mm_projector.proj.0.weight": rand(merged, merged), "mm_projector.proj.0.bias": rand(merged),
              "mm_projector.proj.2.weight": rand(text_hidden, merged), "mm_projector.proj.2.bias": rand(text_hidden)})
    return t


def write_index(out: Path, files: dict[str, dict[str, torch.Tensor]]) -> None:
    weight_map = {k: name for name, tensors in files.items() for k in sorted(tensors)}
    size = sum(t.numel() * t.element_size() for tensors in files.values() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=1) + "\n")


def build(source: Path = SOURCE, out: Path = OUT) -> Path:
    """Write every file of demo-kimi (the language-model file last, so SHA256SUMS covers it)."""
    out.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(source, out)
    vocab_size = source_config(source)["vocab_size"] + len(ids)
    config = kimi_config(source, ids, vocab_size)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text((source / "generation_config.json").read_text())
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    language = language_tensors(source, vocab_size)
    trained = trained_vision(OUT)  # the committed tower, wherever this build writes
    vision = load_file(str(OUT / VISION_FILE)) if trained else vision_tensors(config["text_config"]["hidden_size"])
    save_file(vision, str(out / VISION_FILE), metadata={"format": "pt"})
    save_file(language, str(out / LANGUAGE_FILE), metadata={"format": "pt"})
    write_index(out, {LANGUAGE_FILE: language, VISION_FILE: vision})
    lineage = {"name": "demo-kimi", "built_by": "python -m draftline.demo.kimi (draftline/demo/kimi.py)",
               "language_model": {"from": "demo-deepseek", "source_sha256": sha256_file(source / "model.safetensors"),
                                  "training": json.loads((source / "training.json").read_text())["training"]},
               "vision_tower": trained or {"weights": "random", "seed": VISION_SEED}}
    (out / "training.json").write_text(json.dumps(lineage, indent=1) + "\n")
    write_sha256sums(out)
    return out


def trained_vision(out: Path = OUT) -> dict | None:
    """What training.json says of a trained vision tower (draftline.demo.kimi_vision), if the tower was trained."""
    path = out / "training.json"
    tower = json.loads(path.read_text()).get("vision_tower") if path.is_file() else None
    return tower if tower and tower.get("weights") == "trained" and (out / VISION_FILE).is_file() else None


def write_vision(tensors: dict[str, torch.Tensor], metrics: dict, out: Path = OUT) -> None:
    """Replace the vision tower's file with trained tensors and record the training (then the index and SHA256SUMS)."""
    save_file(tensors, str(out / VISION_FILE), metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {k for k, v in index["weight_map"].items() if v == VISION_FILE} == set(tensors), sorted(tensors)
    lineage = json.loads((out / "training.json").read_text())
    lineage["vision_tower"] = {"weights": "trained", "built_by": "python -m draftline.demo.kimi_vision", **metrics}
    (out / "training.json").write_text(json.dumps(lineage, indent=1) + "\n")
    write_sha256sums(out)


def mismatches(out: Path = OUT) -> list[str]:
    """Files of demo-kimi that are missing or differ from SHA256SUMS."""
    return sha256_mismatches(out)


def ensure(source: Path = SOURCE, out: Path = OUT) -> Path:
    """Derive the language-model file when it is missing; refuse when the result is not the pinned one."""
    if mismatches(out) == [LANGUAGE_FILE]:
        language = language_tensors(source, json.loads((out / "config.json").read_text())["text_config"]["vocab_size"])
        save_file(language, str(out / LANGUAGE_FILE), metadata={"format": "pt"})
    bad = mismatches(out)
    if bad:
        raise SystemExit(f"assets/demo-kimi: {', '.join(bad)} differ from SHA256SUMS; "
                         "rebuild with `python -m draftline.demo.kimi --rebuild` and commit the result")
    return out


def main(argv: list[str] | None = None) -> int:
    return asset_main("demo-kimi", OUT, build, ensure, "write every file again (after demo-deepseek changed)", argv,
                      __doc__)


if __name__ == "__main__":
    sys.exit(main())
