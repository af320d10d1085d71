"""The EAGLE-3 head: decode-time cache behaviour, the SGLang/EAGLE file format, vocabulary mapping, bad input."""
import json

import pytest
import torch
from torch import nn
from safetensors import safe_open

from draftline.config import DrafterConfig
from draftline.drafter.eagle_format import load_eagle_dir, save_eagle_dir
from draftline.drafter.target_sizing import drafter_for_target
from draftline.errors import ConfigError

TARGET = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 256,
}


def make_drafter(draft_vocab=100, seed=0):
    torch.manual_seed(seed)
    model = drafter_for_target(TARGET, DrafterConfig(draft_vocab_size=draft_vocab))
    if draft_vocab < TARGET["vocab_size"]:
        used = torch.arange(draft_vocab) * 3  # every third target id
        t2d = torch.zeros(TARGET["vocab_size"], dtype=torch.bool)
        t2d[used] = True
        model.set_vocab(used - torch.arange(draft_vocab), t2d)
    return model.eval()


def test_shapes_and_default_aux_ids_follow_the_target():
    model = make_drafter()
    assert model.config.aux_layer_ids == [2, 4, 5]
    assert model.fc.weight.shape == (64, 3 * 64)
    assert model.midlayer.self_attn.q_proj.weight.shape == (64, 128)  # reads [embedding, hidden]
    assert not model.embed_tokens.weight.requires_grad
    ids = torch.randint(0, 300, (2, 5))
    logits, hidden, cache = model(ids, torch.randn(2, 5, 64), torch.arange(5).expand(2, 5))
    assert logits.shape == (2, 5, 100) and hidden.shape == (2, 5, 64) and cache is None


def test_incremental_decoding_with_cache_and_crop_matches_one_full_pass():
    model = make_drafter()
    ids, hid = torch.randint(0, 300, (1, 9)), torch.randn(1, 9, 64)
    pos = torch.arange(9)[None]
    full_logits, full_hidden, _ = model(ids, hid, pos)

    from draftline.drafter.model import DrafterCache
    cache = DrafterCache()
    parts = []
    for a, b in [(0, 4), (4, 5), (5, 9)]:
        logits, _, cache = model(ids[:, a:b], hid[:, a:b], pos[:, a:b], cache)
        parts.append(logits)
    torch.testing.assert_close(torch.cat(parts, 1), full_logits, atol=1e-5, rtol=1e-5)

    # A rejected draft: feed junk at slots 6..8, roll back to 6, then the true slots give the full-pass answer.
    cache.crop(6)
    model(torch.randint(0, 300, (1, 3)), torch.randn(1, 3, 64), pos[:, 6:9], cache)
    cache.crop(6)
    logits, hidden, cache = model(ids[:, 6:9], hid[:, 6:9], pos[:, 6:9], cache)
    torch.testing.assert_close(logits, full_logits[:, 6:9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, full_hidden[:, 6:9], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        cache.crop(10)


def test_draft_to_target_uses_d2t_offsets():
    model = make_drafter()
    assert model.draft_to_target(torch.tensor([0, 1, 99])).tolist() == [0, 3, 297]
    assert model.draft_token_ids[:3].tolist() == [0, 3, 6]


def test_save_and_load_roundtrip_in_the_sglang_format(tmp_path):
    model = make_drafter()
    save_eagle_dir(model, tmp_path / "d", dtype=torch.float32)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["num_hidden_layers"] == 1 and raw["draft_vocab_size"] == 100 and raw["vocab_size"] == 300
    assert raw["target_hidden_size"] == 64
    # SGLang reads "output of layer k": one less than the vLLM ids [2, 4, 5] for the same tensors.
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight", "embed_tokens.weight"} <= keys

    loaded = load_eagle_dir(tmp_path / "d").eval()
    assert loaded.config.aux_layer_ids == [2, 4, 5]
    ids, hid, pos = torch.randint(0, 300, (1, 6)), torch.randn(1, 6, 64), torch.arange(6)[None]
    torch.testing.assert_close(loaded(ids, hid, pos)[0], model(ids, hid, pos)[0])
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)


def test_full_vocabulary_export_has_no_d2t(tmp_path):
    model = make_drafter(draft_vocab=300)
    save_eagle_dir(model, tmp_path / "d")
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        assert "d2t" not in f.keys() and "t2d" not in f.keys()
    loaded = load_eagle_dir(tmp_path / "d")
    assert loaded.draft_to_target(torch.tensor([7])).item() == 7


def test_reduced_vocabulary_without_d2t_is_refused(tmp_path):
    model = make_drafter()
    save_eagle_dir(model, tmp_path / "d")
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ConfigError, match="no d2t"):
        load_eagle_dir(tmp_path / "d")


def test_aux_ids_beyond_the_target_layers_are_refused():
    with pytest.raises(ConfigError, match="contradict a target with 8 layers"):
        drafter_for_target(TARGET, DrafterConfig(draft_vocab_size=100), aux_layer_ids=[2, 4, 8])


def test_a_weight_used_at_every_step_gets_the_sum_of_its_gradients_through_its_cast():
    """Training sums a weight's gradient over the unrolled steps in place (StepWeights); through a real cast (fp32
    weight, bf16 matmuls, as on a GPU) the weight must still get what autograd's own sum gives, once, in fp32."""
    from draftline.drafter.speed import StepWeights

    torch.manual_seed(0)
    lin = nn.Linear(8, 8, bias=False)
    x0 = torch.randn(2, 5, 8).bfloat16()
    probe = torch.randn(2, 5, 8).bfloat16()

    def unrolled(linear):  # each step reads the previous one's output, like the TTT chain
        x, loss = x0, 0
        for _ in range(4):
            x = torch.tanh(linear(x))
            loss = loss + (x * probe).float().sum()
        return loss

    steps = StepWeights()
    (ours,) = torch.autograd.grad(unrolled(lambda x: steps.linear(lin, x)), [lin.weight])
    cast = lin.weight.to(torch.bfloat16)
    (reference,) = torch.autograd.grad(unrolled(lambda x: x @ cast.t()), [lin.weight])
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference, rtol=2e-2, atol=2e-2)
    assert ours.abs().sum() > 0


MLA_TARGET = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8, "num_attention_heads": 4,
              "num_key_value_heads": 4, "vocab_size": 300, "q_lora_rank": 24, "kv_lora_rank": 32,
              "qk_nope_head_dim": 8, "qk_rope_head_dim": 16, "v_head_dim": 12, "rope_theta": 10000.0}


def test_mla_head_takes_the_targets_latent_sizes_and_round_trips_in_the_engines_mla_layout(tmp_path):
    """drafter.attention: mla gives DeepSeek's attention with the target's sizes, saved under the class and keys vLLM's
    and SGLang's MLA EAGLE-3 heads load (Eagle3DeepseekV2ForCausalLM; q_a/q_b, kv_a_proj_with_mqa, kv_b)."""
    torch.manual_seed(0)
    model = drafter_for_target(MLA_TARGET, DrafterConfig(draft_vocab_size=300, attention="mla")).eval()
    cfg = model.config
    assert (cfg.head_dim, cfg.rope_dim, cfg.value_dim, cfg.kv_lora_rank) == (24, 16, 12, 32)
    att = model.midlayer.self_attn
    assert att.kv_a_proj_with_mqa.weight.shape == (32 + 16, 128) and att.o_proj.weight.shape == (64, 4 * 12)
    save_eagle_dir(model, tmp_path / "mla", convention="vllm")
    written = json.loads((tmp_path / "mla" / "config.json").read_text())
    assert written["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and written["model_type"] == "deepseek_v2"
    assert written["rope_interleave"] is True and written["rope_parameters"]["rope_type"] == "default"
    again = load_eagle_dir(tmp_path / "mla").eval()
    assert again.config.attention == "mla" and again.config.head_dim == 24
    ids, hidden, pos = torch.randint(0, 300, (1, 5)), torch.randn(1, 5, 64), torch.arange(5)[None]
    torch.testing.assert_close(again(ids, hidden, pos)[0], model.to(torch.bfloat16).float()(ids, hidden, pos)[0],
                               atol=1e-5, rtol=1e-5)


def test_mla_rope_on_reordered_halves_gives_the_scores_of_deepseeks_interleaved_rope():
    """DeepSeek (and vLLM's MLA head) turns adjacent pairs; the head turns halves of a reordered vector: q.k agrees."""
    from draftline.drafter.model import apply_rope, interleaved_to_halves, rope_cos_sin

    torch.manual_seed(0)
    q, k, pos = torch.randn(2, 7, 16), torch.randn(2, 7, 16), torch.arange(7)[None].expand(2, 7)

    def interleaved(x):
        inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
        angle = pos[..., None].float() * inv
        even, odd = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = even * angle.cos() - odd * angle.sin()
        out[..., 1::2] = even * angle.sin() + odd * angle.cos()
        return out

    cos, sin = rope_cos_sin(pos, 16, 10000.0, torch.float32)
    ours = [apply_rope(interleaved_to_halves(x)[:, None], cos, sin)[:, 0] for x in (q, k)]
    torch.testing.assert_close(ours[0] @ ours[1].transpose(-1, -2), interleaved(q) @ interleaved(k).transpose(-1, -2),
                               atol=1e-4, rtol=1e-4)


def test_an_mla_head_needs_an_mla_target_and_the_speculators_format_is_refused_for_it():
    from pydantic import ValidationError

    from draftline.config import PipelineConfig

    with pytest.raises(ConfigError, match="the target config has no q_lora_rank, kv_lora_rank"):
        drafter_for_target(TARGET, DrafterConfig(attention="mla"))
    base = {"target": {"path": "t"}, "traces": {"prompts": "p"}, "eval": {"prompts": "p"}, "drafter": {"attention": "mla"}}
    with pytest.raises(ValidationError, match="speculators, whose format describes Llama-layer heads only"):
        PipelineConfig.model_validate(base)
    assert PipelineConfig.model_validate({**base, "export": {"formats": ["vllm", "sglang"]}}).drafter.attention == "mla"
