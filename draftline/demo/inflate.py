"""A demo Llama embedded in a larger Llama shape, so GPU benchmarks run a >=1B-parameter target that writes Python.

A random-weight target of that size only repeats itself, so a drafter trained on it measures nothing. The inflated
target computes exactly the demo target's function at the full compute cost of the large shape:

- the residual stream keeps the demo's values in its first `hidden` dimensions and exact zeros elsewhere (every
  weight that writes into the residual stream is zero outside the demo's block);
- the demo's layers sit at evenly spaced depths; the layers between them are complete Llama layers with random
  weights whose output projections (o_proj, down_proj) are zero, so they cost a full layer and add nothing;
- extra attention heads, KV heads and MLP channels carry random weights; their outputs are dropped by zero columns
  of o_proj / down_proj;
- RMSNorm averages over the full width, so norm weights are scaled by sqrt(small/large) and eps by small/large,
  which makes each normalised value equal to the demo's.
"""
from __future__ import annotations

import math

import torch

# Llama-3.2-1B's shape with the MLP widened from 8192 to 8704 so the total passes 1B with the demo's 4096-token
# vocabulary (16 x 63.9M layer parameters + 2 x 4096 x 2048 embeddings = 1.04B).
ONE_B_SHAPE = dict(hidden_size=2048, intermediate_size=8704, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=64)
# Llama-3-8B's widths and depth with the demo's 64-wide heads (64 query heads instead of 32 of 128, the same
# projection sizes): a target big enough that a decoding step is bound by the GPU, not by an engine's host work.
EIGHT_B_SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=64,
                     num_key_value_heads=8, head_dim=64)
SHAPES = {"1b": ONE_B_SHAPE, "8b": EIGHT_B_SHAPE}


def parameter_count(config: dict) -> int:
    """Parameters of a Llama with untied embeddings and no biases, from its config's sizes."""
    h, d = config["hidden_size"], config["head_dim"]
    attention = 2 * h * d * (config["num_attention_heads"] + config["num_key_value_heads"])
    layer = attention + 3 * h * config["intermediate_size"] + 2 * h
    return config["num_hidden_layers"] * layer + 2 * config["vocab_size"] * h + h


def _check(small, large: dict) -> None:
    s = small.config
    problems = []
    if large["head_dim"] != s.head_dim:
        problems.append(f"head_dim {large['head_dim']} differs from the demo's {s.head_dim}")
    if large["num_hidden_layers"] < s.num_hidden_layers:
        problems.append("fewer layers than the demo")
    small_group = s.num_attention_heads // s.num_key_value_heads
    large_group = large["num_attention_heads"] // large["num_key_value_heads"]
    if large["num_key_value_heads"] < s.num_key_value_heads or large_group < small_group:
        problems.append("fewer KV heads or a smaller query group than the demo")
    if large["hidden_size"] < s.hidden_size or large["intermediate_size"] < s.intermediate_size:
        problems.append("a narrower hidden or MLP size than the demo")
    if problems:
        raise ValueError(f"cannot embed the demo target in this shape: {'; '.join(problems)}")


def layer_positions(small_layers: int, large_layers: int) -> list[int]:
    """Where the demo's layers sit in the large stack: evenly spaced, the first at depth 0."""
    return [i * large_layers // small_layers for i in range(small_layers)]


@torch.no_grad()
def inflate_llama(small, shape: dict | None = None, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                  device: str | torch.device = "cpu"):
    """A LlamaForCausalLM of `shape` (default ONE_B_SHAPE) whose logits equal `small`'s (up to float rounding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    large = {**ONE_B_SHAPE, **(shape or {})}
    _check(small, large)
    s = small.config
    ratio = s.hidden_size / large["hidden_size"]
    cfg_dict = s.to_dict()
    for key in ("architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        cfg_dict.pop(key, None)
    cfg = LlamaConfig(**{**cfg_dict, **large, "rms_norm_eps": s.rms_norm_eps * ratio})
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    for p in model.parameters():  # random everywhere first: the parts that end in a zero projection stay so
        p.normal_(0.0, cfg.initializer_range)
    hs = s.hidden_size
    d = s.head_dim
    small_group, large_group = s.num_attention_heads // s.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    # Query head q of the demo (KV head q // small_group) goes where the large model reads the same KV head.
    q_heads = [(q // small_group) * large_group + q % small_group for q in range(s.num_attention_heads)]
    norm_scale = math.sqrt(ratio)

    def put(dst, src, rows, cols=slice(0, hs)):
        dst[rows, cols] = src.to(dst.device, dst.dtype)

    def head_rows(heads):
        return torch.cat([torch.arange(x * d, (x + 1) * d) for x in heads])

    sm, lm = small.model, model.model
    lm.embed_tokens.weight.zero_()
    put(lm.embed_tokens.weight, sm.embed_tokens.weight, slice(None))
    lm.norm.weight.fill_(1.0)
    lm.norm.weight[:hs] = sm.norm.weight * norm_scale
    put(model.lm_head.weight, small.lm_head.weight, slice(None))
    qrows, kvrows = head_rows(q_heads), head_rows(range(s.num_key_value_heads))
    real = dict(zip(layer_positions(s.num_hidden_layers, cfg.num_hidden_layers), sm.layers))
    for i, layer in enumerate(lm.layers):
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        src = real.get(i)
        if src is None:
            continue
        layer.input_layernorm.weight[:hs] = src.input_layernorm.weight * norm_scale
        layer.post_attention_layernorm.weight[:hs] = src.post_attention_layernorm.weight * norm_scale
        put(layer.self_attn.q_proj.weight, src.self_attn.q_proj.weight, qrows)
        put(layer.self_attn.k_proj.weight, src.self_attn.k_proj.weight, kvrows)
        put(layer.self_attn.v_proj.weight, src.self_attn.v_proj.weight, kvrows)
        o = layer.self_attn.o_proj.weight
        o[:hs, qrows] = src.self_attn.o_proj.weight.to(o.device, o.dtype)
        put(layer.mlp.gate_proj.weight, src.mlp.gate_proj.weight, slice(0, s.intermediate_size))
        put(layer.mlp.up_proj.weight, src.mlp.up_proj.weight, slice(0, s.intermediate_size))
        dp = layer.mlp.down_proj.weight
        dp[:hs, :s.intermediate_size] = src.mlp.down_proj.weight.to(dp.device, dp.dtype)
    return model.eval()
