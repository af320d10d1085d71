"""demo-kimi: Kimi-K2.5's own class around demo-deepseek's language model, as transformers and draftline read it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftline.aux_ids import sglang_convention
from draftline.demo import kimi
from draftline.drafter.train import load_target_head
from draftline.engines.preflight import check_architecture, check_drafter_target_fields
from draftline.errors import ConfigError
from draftline.target import decoder_layers, load_target, num_layers

ASSETS = Path(__file__).resolve().parents[1] / "assets"
KIMI, DEEPSEEK = ASSETS / "demo-kimi", ASSETS / "demo-deepseek"


def test_demo_kimi_is_derived_from_demo_deepseek_byte_for_byte(tmp_path):
    """A fresh build from demo-deepseek gives exactly the committed SHA256SUMS, so every machine's derived weights
    file is the pinned one, and the checkout's own files match it."""
    kimi.build(DEEPSEEK, tmp_path / "demo-kimi")
    assert (tmp_path / "demo-kimi" / "SHA256SUMS").read_text() == (KIMI / "SHA256SUMS").read_text()
    assert kimi.mismatches(KIMI) == []


def test_a_changed_derived_file_is_named_with_the_command_that_fixes_it(tmp_path):
    out = tmp_path / "demo-kimi"
    kimi.build(DEEPSEEK, out)
    (out / kimi.VISION_FILE).write_bytes(b"not the pinned weights")
    with pytest.raises(SystemExit, match=r"model-vision.safetensors differ from SHA256SUMS; rebuild with "
                                         r"`python -m draftline.demo.kimi --rebuild`"):
        kimi.ensure(DEEPSEEK, out)
    # A missing language-model file is derived again, not an error.
    kimi.build(DEEPSEEK, out)
    (out / kimi.LANGUAGE_FILE).unlink()
    kimi.ensure(DEEPSEEK, out)
    assert kimi.mismatches(out) == []


def test_transformers_loads_every_weight_into_kimi_k25_and_the_text_model_is_demo_deepseek():
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(KIMI, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "Kimi_K25ForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    deepseek = AutoModelForCausalLM.from_pretrained(DEEPSEEK, dtype=torch.float32)
    ids = torch.tensor([[1, 4, 200, 31, 977, 5, 12, 300]])
    with torch.no_grad():
        ours, theirs = model(input_ids=ids).logits[0], deepseek(input_ids=ids).logits[0]
    base = theirs.shape[-1]
    assert torch.equal(ours[:, :base], theirs)
    assert torch.all(ours[:, base:] == 0)  # media tokens: zero rows of lm_head, never above a real token


def test_the_tokenizer_has_kimis_media_tokens_and_renders_images_as_kimis_placeholder():
    from transformers import AutoTokenizer

    tok, base = AutoTokenizer.from_pretrained(KIMI), AutoTokenizer.from_pretrained(DEEPSEEK)
    config = json.loads((KIMI / "config.json").read_text())
    assert len(tok) == config["text_config"]["vocab_size"] == len(base) + 8
    assert tok.convert_tokens_to_ids("<|media_pad|>") == config["image_token_id"]
    assert tok.convert_tokens_to_ids("<|media_begin|>") == config["vision_start_token_id"]
    assert tok.convert_tokens_to_ids("<|media_end|>") == config["vision_end_token_id"]
    text_turn = [{"role": "user", "content": "def f(x):\n    \"\"\"Twice x.\"\"\""}]
    assert (tok.apply_chat_template(text_turn, add_generation_prompt=True, tokenize=False)
            == base.apply_chat_template(text_turn, add_generation_prompt=True, tokenize=False))
    image_turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe"}]}]
    rendered = tok.apply_chat_template(image_turn, add_generation_prompt=True, tokenize=False)
    assert rendered == f"<|bos|><|user|>{kimi.MEDIA_PLACEHOLDER}describe<|end|>\n<|assistant|>"
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert config["image_token_id"] in ids


def test_draftline_reads_the_wrapper_as_its_text_model():
    """Every reader of a target config sees the DeepSeek-V3 text model inside Kimi-K2.5's wrapper."""
    assert num_layers(KIMI) == 8
    text_cfg, embed, head = load_target_head(KIMI)
    assert text_cfg["model_type"] == "deepseek_v3" and embed.shape == head.shape == (4104, 256)
    assert sglang_convention(json.loads((KIMI / "config.json").read_text())) == "sglang-deepseek"
    model, tokenizer = load_target(KIMI, "float32")
    assert len(decoder_layers(model)) == 8 and len(tokenizer) == 4104
    assert check_architecture("vllm", "0.32.0", KIMI) == "KimiK25ForConditionalGeneration"  # EAGLE-3 declared


def test_a_kimi_config_without_the_field_vllms_drafter_loader_reads_is_refused_before_any_server(tmp_path):
    """vLLM 0.32 reads media_placeholder_token_id from a KimiK25ForConditionalGeneration target when it attaches an
    EAGLE-3 drafter and dies at load without it (seen here); Kimi-K2.5's own config.json carries it."""
    arch = "KimiK25ForConditionalGeneration"
    check_drafter_target_fields("vllm", arch, KIMI)
    config = json.loads((KIMI / "config.json").read_text())
    del config["media_placeholder_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"has no media_placeholder_token_id, which vLLM reads from a "
                                          r"KimiK25ForConditionalGeneration target when it loads an EAGLE-3 drafter; "
                                          r"add it .* \(this config's image_token_id is 4099\)"):
        check_drafter_target_fields("vllm", arch, tmp_path)


def test_the_trained_vision_tower_makes_the_greedy_answer_depend_on_the_image():
    """Two of the demo's images, the same question: the target's greedy answers differ, and each names its image
    (the reference decoder's path: the target's own tower fed through draftline.media_reference)."""
    from draftline.conversations import Origin
    from draftline.media_reference import MediaFeed, prompt_media
    from draftline.speculative import plain_decode
    from draftline.traces import encode_prompt

    model, tok = load_target(KIMI, "bfloat16", "cpu")
    answers = {}
    for name in ("red-circle", "letter-A"):
        record = {"id": name, "messages": [{"role": "user", "content": [
            {"type": "image", "image": f"images/{name}.png"}, {"type": "text", "text": "What do you see?"}]}]}
        ids = encode_prompt(tok, record, True, image_refusal=None)
        ids, images = prompt_media(KIMI, record, ids, Origin(name, "messages"), ASSETS / "prompts")
        feed = MediaFeed(model, json.loads((KIMI / "config.json").read_text())["media_placeholder_token_id"])
        feed.rows = [images]
        feed.attach()
        try:
            out = plain_decode(model, [ids], 8, eos_token_ids=[tok.eos_token_id], pad_token_id=0)
        finally:
            feed.detach()
        answers[name] = tok.decode(out.tokens[0], skip_special_tokens=True)
    assert answers == {"red-circle": "a red circle", "letter-A": "the letter A"}
