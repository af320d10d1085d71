"""Arithmetic on model shapes for the planner: a target's parameters, FLOPs and bytes per token, and its EAGLE-3 head's training FLOPs and memory.

Everything here is counting from config.json sizes; no weights are read. Conventions: a matmul of an m x n weight
costs 2 m n FLOPs per token forward; a trained weight costs three times that (forward, input gradient, weight
gradient); attention scores and their weighted sum cost 2 x (query-key width + value width) per head and key.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from draftline.errors import ConfigError
from draftline.state_storage import bytes_per_token

# Bytes a shard stores per token besides the states: int64 input id and uint8 loss mask.
SHARD_TOKEN_EXTRA = 9
# Per sequence: its int64 cu_seqlens entry and its trace id in the header (ids of about 60 characters, quoted).
SHARD_SEQUENCE_EXTRA = 8 + 64


def _get(cfg: dict, name: str, default=None):
    value = cfg.get(name)
    return default if value is None else value


@dataclass(frozen=True)
class TargetShape:
    """The sizes of a target that cost time and memory, counted from its text config."""

    name: str
    layers: int
    hidden: int
    vocab: int
    intermediate: int
    attention_params: int  # all layers
    dense_mlp_params: int  # all layers' MLPs that every token runs: dense layers, shared experts, routers
    expert_params: int  # all routed experts of all layers
    active_expert_params: int  # the routed experts' parameters one token runs
    score_width: int  # all layers: heads x (query-key width + value width)
    experts: int
    experts_per_token: int
    weight_bytes: int
    weight_bytes_source: str
    mla_kv_width: int | None  # MLA's latent cache per token and layer (kv_lora_rank + rope dim), None for GQA
    kv_width: int  # per layer: values a token keeps in the KV cache (keys and values, or MLA's latent)
    moe_layers: int  # layers that route to experts
    expert_byte_share: float = 0.0  # the routed experts' share of weight_bytes (target_shape counts it by kind)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def layer_params(self) -> int:
        return self.attention_params + self.dense_mlp_params + self.expert_params

    @property
    def total_params(self) -> int:
        """Parameters in the checkpoint: layers, embeddings and lm_head."""
        return self.layer_params + 2 * self.embedding_params

    @property
    def active_layer_params(self) -> int:
        """Decoder-layer parameters one token runs through (routed experts: only its own)."""
        return self.attention_params + self.dense_mlp_params + self.active_expert_params

    def prefill_flops(self, context: float) -> float:
        """FLOPs of one token of a whole-sequence forward whose sequences are `context` tokens long (the causal
        mask halves the keys on average); no lm_head: extraction asks for one generated token."""
        return 2.0 * self.active_layer_params + self.score_width * 2.0 * context / 2.0

    def expert_flops(self) -> float:
        """FLOPs of one token in its routed experts (part of prefill_flops and decode_flops)."""
        return 2.0 * self.active_expert_params

    def decode_flops(self, context: float) -> float:
        """FLOPs of one generated token at `context` tokens of history, lm_head included."""
        return 2.0 * (self.active_layer_params + self.embedding_params) + self.score_width * 2.0 * context

    def expert_fraction_read(self, concurrency: float) -> float:
        """Share of the routed experts one decode step reads when `concurrency` tokens each pick experts_per_token
        of them at random."""
        if not self.experts:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_token / self.experts) ** max(1.0, concurrency)

    def decode_step_bytes(self, concurrency: float) -> float:
        """Weight bytes one decode step reads at `concurrency` sequences: everything but the routed experts, and
        the experts those tokens pick."""
        expert_bytes = self.weight_bytes * self.expert_byte_share
        return self.weight_bytes - expert_bytes + expert_bytes * self.expert_fraction_read(concurrency)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV cache bytes one token takes on a device (all layers)."""
        return self.layers * self.kv_width * dtype_bytes


# MoE layouts of other families (Llama 4's interleaved layers and dense width, Jamba's expert period): counted as
# Mixtral's they would give wrong sizes without a word.
UNREAD_MOE_LAYOUT_KEYS = ("interleave_moe_layer_step", "intermediate_size_mlp", "expert_layer_period",
                          "expert_layer_offset")


def _is_moe_layer(text: dict):
    """Whether layer i (from 0) routes to experts: DeepSeek's first_k_dense_replace layers and moe_layer_freq, Qwen's
    mlp_only_layers and decoder_sparse_step; Mixtral's every layer."""
    first_dense = int(_get(text, "first_k_dense_replace", 0))
    freq = int(_get(text, "moe_layer_freq", 1))
    dense_only = set(_get(text, "mlp_only_layers", []))
    step = int(_get(text, "decoder_sparse_step", 1))
    return lambda i: i >= first_dense and i % freq == 0 and i not in dense_only and (i + 1) % step == 0


def target_shape(config: dict, name: str, weight_bytes: int | None = None,
                 weight_bytes_source: str | None = None) -> TargetShape:
    """The shape of a Llama-like, a Qwen or Mixtral MoE, or a DeepSeek-V3-like (MLA, MoE) target from its config.json
    (a multimodal wrapper's text_config is read). Weight bytes: the checkpoint's when given, else its parameters at the
    bytes its quantization_config stores (read_quantization), bf16 without one."""
    text = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    h, layers, vocab = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])
    heads = int(text["num_attention_heads"])
    inter = int(_get(text, "intermediate_size", 4 * h))
    if text.get("kv_lora_rank"):
        q_lora = text.get("q_lora_rank")
        nope, rope, v = int(text["qk_nope_head_dim"]), int(text["qk_rope_head_dim"]), int(text["v_head_dim"])
        kv_lora = int(text["kv_lora_rank"])
        q = (h * q_lora + q_lora * heads * (nope + rope)) if q_lora else h * heads * (nope + rope)
        attention = q + h * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * h
        score, mla_kv, kv_width = heads * (nope + rope + v), kv_lora + rope, kv_lora + rope
    else:
        head_dim = int(_get(text, "head_dim", h // heads))
        kv_heads = int(_get(text, "num_key_value_heads", heads))
        attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
        score, mla_kv, kv_width = heads * 2 * head_dim, None, 2 * kv_heads * head_dim
    # DeepSeek names its routed experts n_routed_experts, Mixtral num_local_experts, Qwen's MoE num_experts.
    experts = int(_get(text, "n_routed_experts", 0) or _get(text, "num_local_experts", 0)
                  or _get(text, "num_experts", 0) or 0)
    per_token = int(_get(text, "num_experts_per_tok", 0) or 0)
    if experts:
        unread = [k for k in UNREAD_MOE_LAYOUT_KEYS if k in text]
        if unread:
            raise ConfigError(f"the target's config.json lays out its experts with {', '.join(unread)}, which the "
                              "planner does not count; it plans Llama-like, Qwen and Mixtral MoE and DeepSeek-V3-like "
                              "targets only")
        moe_inter = int(_get(text, "moe_intermediate_size", inter))  # Mixtral's experts are intermediate_size wide
        moe_layers = sum(map(_is_moe_layer(text), range(layers)))
        dense_layers = layers - moe_layers
        # Shared experts every token runs: DeepSeek's n_shared_experts of the routed width, Qwen2-MoE's one of its own.
        shared = (int(_get(text, "n_shared_experts", 0)) * moe_inter
                  + int(_get(text, "shared_expert_intermediate_size", 0)))
        dense_mlp = dense_layers * 3 * h * inter + moe_layers * (3 * h * shared + h * experts)
        expert_params = moe_layers * experts * 3 * h * moe_inter
        active_experts = moe_layers * per_token * 3 * h * moe_inter
    else:
        dense_mlp, expert_params, active_experts, moe_layers = layers * 3 * h * inter, 0, 0, 0
    shape = TargetShape(name=name, layers=layers, hidden=h, vocab=vocab, intermediate=inter,
                        attention_params=layers * attention, dense_mlp_params=dense_mlp, expert_params=expert_params,
                        active_expert_params=active_experts, score_width=layers * score, experts=experts,
                        experts_per_token=per_token, weight_bytes=0, weight_bytes_source="", mla_kv_width=mla_kv,
                        kv_width=kv_width, moe_layers=moe_layers)
    try:
        per = read_quantization(config)
    except (ConfigError, ValueError, TypeError, LookupError, AttributeError, re.error):
        if weight_bytes is None:
            raise
        per = None  # the checkpoint's bytes are known: a quantization_config it cannot read splits them by parameters
    # Bytes by kind: quantized experts beside bf16 attention make the experts' share of the bytes smaller than
    # their share of the parameters, and a decoding step reads all of the rest.
    sizes = per or {"attention": 2, "dense": 2, "shared": 2, "experts": 2}
    dense_layer_params = (layers - moe_layers) * 3 * h * inter  # dense_mlp's rest: shared experts, routers
    counted = ((shape.total_params - shape.layer_params) * 2 + shape.attention_params * sizes["attention"]
               + dense_layer_params * sizes["dense"] + (shape.dense_mlp_params - dense_layer_params) * sizes["shared"]
               + expert_params * sizes["experts"])
    if weight_bytes is None:
        weight_bytes = int(counted)
        weight_bytes_source = f"parameters: {per['source']}" if per else "parameters x 2 bytes (bf16)"
    return TargetShape(**{**shape.__dict__, "weight_bytes": int(weight_bytes),
                          "weight_bytes_source": weight_bytes_source or "the checkpoint's files",
                          "expert_byte_share": expert_params * sizes["experts"] / counted if counted else 0.0})


# A module of each kind under the names quantization ignore lists match (DeepSeek's layout; Qwen's shared expert).
_SAMPLE_MODULES = {"attention": ["model.layers.1.self_attn.o_proj"], "dense": ["model.layers.0.mlp.down_proj"],
                   "shared": ["model.layers.1.mlp.shared_experts.down_proj",
                              "model.layers.1.mlp.shared_expert.down_proj"],
                   "experts": ["model.layers.1.mlp.experts.0.down_proj"]}


def read_quantization(config: dict) -> dict | None:
    """Bytes per weight of attention, dense MLPs, shared and routed experts from the config's quantization_config
    (in its text_config or at its top), None when it has none: compressed-tensors with one weight scheme (the modules
    its ignore list names stay bf16) and fp8 with block scales. Anything else is refused in one sentence."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    q = text.get("quantization_config") or config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        per = 1 + (4 / (block[0] * block[1]) if block else 0.0)  # a float32 scale per block
        return {"attention": per, "dense": per, "shared": per, "experts": per,
                "source": f"bf16 embeddings, every other matrix fp8 (blocks {block or 'per tensor'})"}
    schemes = [g.get("weights") for g in (q.get("config_groups") or {}).values() if g.get("weights")]
    if method == "compressed-tensors" and len(schemes) == 1 and schemes[0].get("num_bits"):
        w = schemes[0]
        bits, strategy, group = int(w["num_bits"]), w.get("strategy"), w.get("group_size")
        # A bf16 scale per group; NVFP4's tensor groups an fp8 one (and one per tensor); per channel: negligible.
        scale = {"group": 2, "tensor_group": 1}.get(strategy, 0) / group if group else 0.0
        patterns = q.get("ignore") or []

        def ignored(names: list[str]) -> bool:  # checkpoints name modules with or without a wrapper's prefix
            return any(re.match(e[3:], n) if e.startswith("re:") else n == e or n.endswith("." + e)
                       or e.endswith("." + n) for e in patterns for n in names)
        sizes = {kind: 2.0 if ignored(names) else bits / 8 + scale for kind, names in _SAMPLE_MODULES.items()}
        kept = [kind for kind, size in sizes.items() if size == 2.0]
        return {**sizes, "source": f"compressed-tensors {w.get('type', 'int')}{bits} with "
                                   + (f"a scale per {group} weights" if scale else "per-channel scales")
                                   + (f", {', '.join(kept)} kept in bf16" if kept else "")}
    what = f"quant_method {method!r}" + (f" with {len(schemes)} weight schemes" if len(schemes) > 1 else "")
    raise ConfigError(f"the target's config.json quantizes its weights with {what}, which the planner does not "
                      "read; put the checkpoint's weight index (model.safetensors.index.json, with its total_size) "
                      "beside config.json")


# Weight indexes that carry a checkpoint's total_size: safetensors', and PyTorch's for .bin checkpoints.
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def stored_weight_bytes(target_dir: str | Path) -> tuple[int, str] | None:
    """Bytes of a local checkpoint and where they were read: its weight index's total_size (the whole checkpoint even
    while its files are still downloading), else its safetensors files; None when it has neither."""
    import json

    root = Path(target_dir)
    for name in WEIGHT_INDEXES:
        if (root / name).is_file():
            total = json.loads((root / name).read_text()).get("metadata", {}).get("total_size")
            if total:
                return int(total), f"{name}'s total_size"
    size = checkpoint_bytes(root)
    return None if size is None else (size, f"{root}'s safetensors files")


def checkpoint_bytes(target_dir: str | Path) -> int | None:
    """Bytes of a local checkpoint's safetensors files, None when it has none."""
    files = list(Path(target_dir).glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def hidden_state_bytes(tokens: float, sequences: float, hidden: int, storage: str) -> float:
    """Bytes of the hidden-state shards of `tokens` tokens in `sequences` traces (headers of a few KB per shard
    aside): the four states, ids and loss mask per token, a cu_seqlens entry and a trace id per sequence."""
    return tokens * (bytes_per_token(hidden, storage) + SHARD_TOKEN_EXTRA) + sequences * SHARD_SEQUENCE_EXTRA


def trace_bytes(tokens: float, answer_tokens: float, sequences: float, vocab: int,
                text_bytes_per_token: float) -> float:
    """Bytes of the JSON-lines traces: per token its id in decimal (ids spread evenly over the vocabulary) and ", ",
    its loss-mask digit and ", "; per answer token its decoded text; per trace the keys and ids (about 120 bytes)."""
    digits = _mean_digits(vocab)
    return tokens * (digits + 2 + 3) + answer_tokens * text_bytes_per_token + sequences * 120


def _mean_digits(vocab: int) -> float:
    total, low = 0, 0
    for d in range(1, 12):
        high = min(vocab, 10 ** d)
        if high > low:
            total += (high - low) * d
        low = max(low, high)
    return total / max(1, vocab)


# ---------------------------------------------------------------- the EAGLE-3 head

@dataclass(frozen=True)
class DrafterShape:
    """The trained head: one decoder layer over [embedding, fc(aux states)], its lm_head over the draft vocabulary."""

    hidden: int
    intermediate: int
    query_width: int  # heads x query-key width
    kv_width: int  # key and value projections' outputs together
    value_width: int  # heads x value width
    vocab: int
    draft_vocab: int

    @property
    def layer_params(self) -> int:
        # q, k, v read the concatenated 2 x hidden input; o maps the heads back; a gated MLP.
        return 2 * self.hidden * (self.query_width + self.kv_width) + self.value_width * self.hidden \
            + 3 * self.hidden * self.intermediate

    @property
    def trained_params(self) -> int:
        return 3 * self.hidden * self.hidden + self.layer_params + self.hidden * self.draft_vocab

    def train_flops_per_token(self, ttt_steps: int, context: float, loss_share: float) -> float:
        """Matmul FLOPs of one training token: fc (forward and weight gradient), the layer trained at each unrolled
        step with causal attention over `context` keys, the target's lm_head forward, and the draft lm_head trained
        on the loss rows (`loss_share` of the tokens, at each step)."""
        h = self.hidden
        layer = 2 * self.layer_params + 2 * (self.query_width + self.value_width) * context / 2
        return (2 * 2 * 3 * h * h + 3 * ttt_steps * layer + 2 * h * self.vocab
                + 3 * 2 * h * self.draft_vocab * ttt_steps * loss_share)

    def state_bytes(self) -> int:
        """Training state on a device: trained weights, gradients and AdamW's two moments in fp32, the frozen
        embedding in fp32 and the target's lm_head in bf16."""
        return 16 * self.trained_params + 4 * self.vocab * self.hidden + 2 * self.vocab * self.hidden

    def checkpoint_bytes(self) -> int:
        """One checkpoint: the drafter's state dict (embedding included) and AdamW's moments, fp32."""
        return 4 * (self.trained_params + self.vocab * self.hidden) + 8 * self.trained_params

    def export_bytes(self) -> int:
        """One exported format: trained weights and the embedding in bf16."""
        return 2 * (self.trained_params + self.vocab * self.hidden)


def drafter_shape(eagle_config) -> DrafterShape:
    """From draftline's Eagle3Config (config_for_target or warm_start_config)."""
    c = eagle_config
    if c.attention == "mla":
        q = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
        kv = c.kv_lora_rank + c.qk_rope_head_dim + c.kv_lora_rank * 0  # the latent; its up-projections below
        kv += c.kv_lora_rank * c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim) // (2 * c.hidden_size)
        value = c.num_attention_heads * c.v_head_dim
    else:
        q = c.num_attention_heads * c.head_dim
        kv = 2 * c.num_key_value_heads * c.head_dim
        value = q
    return DrafterShape(hidden=c.hidden_size, intermediate=c.intermediate_size, query_width=q, kv_width=kv,
                        value_width=value, vocab=c.vocab_size, draft_vocab=c.draft_vocab_size)


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b))
