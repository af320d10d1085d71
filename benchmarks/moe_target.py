"""A random-weight Qwen3-MoE target with the demo tokenizer, written as a checkpoint, for timing an MoE in the engines.

Random weights answer nothing useful, so this target serves only measurements that do not depend on what it says:
starts, decoding speed (with ignore_eos), extraction speed and the agreement of two backends' hidden states. Its router
weights are random too, so tokens spread over the experts about evenly, as the planner assumes. The checkpoint uses
the per-expert tensor names of Qwen's published MoE checkpoints, which vLLM and transformers both read.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "assets" / "demo-llama"

# Qwen3-30B-A3B's width, heads and expert width, with half its layers and half its experts (7.7B parameters, 1.4B of
# them run per token), so one GPU holds it with room for the KV cache; and a tiny one for a CPU smoke run.
MOE_SHAPES = {
    "moe": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144),
    "moe-tiny": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, intermediate_size=512),
}
SHARD_BYTES = 2 << 30


def moe_config(shape: str) -> dict:
    demo = json.loads((DEMO / "config.json").read_text())
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **MOE_SHAPES[shape],
            "vocab_size": demo["vocab_size"], "bos_token_id": demo["bos_token_id"],
            "eos_token_id": demo["eos_token_id"], "pad_token_id": demo["pad_token_id"], "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "norm_topk_prob": True, "output_router_logits": False, "router_aux_loss_coef": 0.001,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False}


def _tensor_shapes(c: dict):
    """(name, shape) of every tensor, in the order of Qwen's checkpoints."""
    h, d, v = c["hidden_size"], c["head_dim"], c["vocab_size"]
    q, kv, e, w = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["num_experts"], c["moe_intermediate_size"]
    yield "model.embed_tokens.weight", (v, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "self_attn.q_norm.weight", (d,)
        yield p + "self_attn.k_norm.weight", (d,)
        yield p + "mlp.gate.weight", (e, h)
        for j in range(e):
            yield p + f"mlp.experts.{j}.gate_proj.weight", (w, h)
            yield p + f"mlp.experts.{j}.up_proj.weight", (w, h)
            yield p + f"mlp.experts.{j}.down_proj.weight", (h, w)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def build_moe_target(folder: Path, shape: str, seed: int = 0) -> Path:
    """Writes the random target into folder/qwen3-moe-<shape> (bf16, norms at one, every matrix N(0, 0.02^2)) with
    the demo's tokenizer; returns that folder."""
    from safetensors.torch import save_file

    config = moe_config(shape)
    target = folder / f"qwen3-moe-{shape}"
    target.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    files: list[str] = []

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(target / name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
        files.append(name)
        shard.clear()

    size = 0
    for name, dims in _tensor_shapes(config):
        if len(dims) == 1:
            t = torch.ones(dims, dtype=torch.bfloat16)
        else:
            t = (torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
        shard[name] = t
        size += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
            size = 0
    if shard:
        flush()
    total = sum((target / f).stat().st_size for f in files)
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": index}, indent=1))
    (target / "config.json").write_text(json.dumps(config, indent=1))
    copy_demo_tokenizer(target)
    return target


def copy_demo_tokenizer(target: Path) -> None:
    """The demo's tokenizer and generation config, beside a target built from its vocabulary."""
    for f in DEMO.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, target / f.name)
