"""The EAGLE-3 draft head: fc over three target aux states, one Llama layer over [embedding, hidden], lm_head over the draft vocabulary."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftline.aux_ids import AuxLayerIds
from draftline.drafter.speed import (StepWeights, compiled_on_device, matmul_dtype, matmul_inputs, project,
                                     project_each, recomputed)
from draftline.errors import ConfigError

ATTENTIONS = ("llama", "mla")
MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass
class Eagle3Config:
    """Shapes of the draft head, and which target layers feed it (ids always in vLLM's convention here)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (embeddings, t2d)
    draft_vocab_size: int  # rows of lm_head
    target_hidden_size: int
    aux_layer_ids: list[int]  # input of layer k (vLLM convention)
    target_num_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    extra: dict[str, Any] = field(default_factory=dict)
    # "mla": DeepSeek's multi-head latent attention (vLLM's Eagle3DeepseekV2ForCausalLM), for MLA targets: its sizes
    # below; head_dim is then qk_nope_head_dim + qk_rope_head_dim (queries and keys) and values have v_head_dim.
    attention: str = "llama"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    @property
    def rope_dim(self) -> int:
        """The width RoPE turns: the whole head for Llama attention, the rope part of q and k for MLA."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def value_dim(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self.head_dim

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"drafter attention={self.attention!r} is unknown; use one of {list(ATTENTIONS)}")
        if self.attention == "mla":
            sizes = {n: getattr(self, n) for n in MLA_SIZES}
            if any(v is None or v < 1 for v in sizes.values()):
                raise ConfigError(f"an MLA drafter needs {', '.join(MLA_SIZES)} (got {sizes}); take them from an MLA "
                                  "target's config or use drafter.attention: llama")
            if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim or \
                    self.num_key_value_heads != self.num_attention_heads:
                raise ConfigError("an MLA drafter has head_dim = qk_nope_head_dim + qk_rope_head_dim and one key/value "
                                  "head per query head")
        if self.hidden_act != "silu":
            raise ConfigError(f"drafter hidden_act={self.hidden_act!r} is not supported; EAGLE-3 heads use 'silu'")
        ids = AuxLayerIds.of(self.aux_layer_ids)
        if self.target_num_layers is not None:
            ids.check_fits(self.target_num_layers)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"drafter num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; pick a divisor"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"draft_vocab_size={self.draft_vocab_size} exceeds the target vocab_size={self.vocab_size}; "
                "set drafter.draft_vocab_size at most the target's"
            )


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Llama's RMSNorm, normalised in fp32 so bf16 runs match the engines' kernels closely. out_dtype: the dtype
    of the matmul it feeds, cast here (the same values that matmul's own cast would give) so that, compiled, the
    kernel writes half the bytes and the gradients coming back need no cast per consumer."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * x.to(dtype)
    return y if out_dtype is None else y.to(out_dtype)


def norm_pair_cat(embeds: torch.Tensor, hidden: torch.Tensor, w_embeds: torch.Tensor, w_hidden: torch.Tensor,
                  eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The attention input: [norm(embeds), norm(hidden)] along the last dimension."""
    return torch.cat([rms_norm(embeds, w_embeds, eps, out_dtype), rms_norm(hidden, w_hidden, eps, out_dtype)], dim=-1)


def rope_qk(q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, theta: float):
    """Rotary on q and k [B, heads, T, hd] at position_ids."""
    return rope_qk_tables(q, k, *rope_cos_sin(position_ids, q.shape[-1], theta, q.dtype))


def rope_tables(position_ids: torch.Tensor, steps: int, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and sin [steps, B, T, 1, head_dim] at position_ids + j for each TTT step j, for q and k in the
    projections' own [B, T, heads, head_dim] layout: made once per unroll by the same code as the decoders' angles."""
    shifted = position_ids[None] + torch.arange(steps, device=position_ids.device)[:, None, None]
    cos, sin = rope_cos_sin(shifted.flatten(0, 1), head_dim, theta, dtype)  # [steps*B, 1, T, hd]
    return tuple(c.view(steps, *position_ids.shape, head_dim).unsqueeze(-2) for c in (cos, sin))


def rope_qk_tables(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary on q and k [B, T, heads, hd] with cos/sin [B, T, 1, hd] from rope_tables. Compiled, one kernel reads
    and writes both contiguously; with the angles computed inside and q in [B, heads, T, hd], an H200 profile showed
    this step's rotary at 10x its memory time (the angles recomputed for every head, the writes strided)."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


# The training forward's variants: compiled into a kernel or two on CUDA, the plain functions elsewhere.
silu_mul_fused = compiled_on_device(silu_mul)
rms_norm_fused = compiled_on_device(rms_norm)
norm_pair_cat_fused = compiled_on_device(norm_pair_cat)
rope_qk_tables_fused = compiled_on_device(rope_qk_tables)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """fused (training): compiled on CUDA, and the output already in the matmul dtype it feeds."""
        if fused:
            return rms_norm_fused(x, self.weight, self.eps, matmul_dtype(x))
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [B, 1, T, head_dim] for Llama's rotate-half (NeoX) rotary embedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Projections of the draft layer's attention; q/k/v read the 2*H concatenation."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)


class MLAAttention(nn.Module):
    """DeepSeek's multi-head latent attention over the 2*H concatenation, with vLLM's EAGLE-3 MLA head's parameter
    names: q through a low-rank q_a/q_b pair, keys and values from one compressed latent (kv_a, normed, kv_b) plus a
    rope part shared by every head."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.q_a_proj = nn.Linear(2 * h, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * cfg.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * cfg.v_head_dim, h, bias=False)


def interleaved_to_halves(x: torch.Tensor) -> torch.Tensor:
    """Reorder the last dimension (x0, x1, x2, ...) -> (x0, x2, ..., x1, x3, ...). DeepSeek's rope turns adjacent
    pairs; on the reordered vector rotate-half RoPE turns the same pairs by the same angles, and q.k is unchanged by
    a reordering both share, so the drafter keeps one RoPE implementation."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, fused: bool = False, steps: StepWeights | None = None):
        # silu(gate) * up is recomputed in backward: [tokens x intermediate] tensors are the layer's largest.
        act = silu_mul_fused if fused else silu_mul
        # Two matmuls, not one over stacked weights as for q/k/v: at this width both are already large, and the
        # compiled SiLU then reads strided halves and the backward needs a cat (2 to 3 ms more a step on an H200).
        to_gate, to_up = matmul_inputs(x, 2)
        gate, up = project(self.gate_proj, to_gate, steps), project(self.up_proj, to_up, steps)
        return project(self.down_proj, recomputed(act, gate, up), steps)


class DecoderLayer(nn.Module):
    """The single draft layer, split in two halves so training can run its own (TTT) attention in between."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None, fused: bool = False,
            rope: tuple[torch.Tensor, torch.Tensor] | None = None, steps: StepWeights | None = None):
        """q [B, nh, T, hd], k/v [B, nkv, T, hd] with RoPE applied at position_ids (or with rope, this step's cos
        and sin from rope_tables; q and k are then transposed views of [B, T, heads, hd]).

        fused: the elementwise parts compiled on CUDA (training); off, the eager code the decoders capture.
        steps: the unrolled training forward's weights (one cast, gradients summed in place over the steps)."""
        b, t, _ = hidden.shape
        cfg = self.cfg
        att = self.self_attn
        # The norms are recomputed in backward from the bf16 inputs instead of keeping their fp32 intermediates.
        x = recomputed(self.attention_input, embeds, hidden, fused)
        if cfg.attention == "mla":
            return self.mla_qkv(x, position_ids, fused, rope, steps)
        q, k, v = project_each((att.q_proj, att.k_proj, att.v_proj), x, steps)
        q = q.view(b, t, cfg.num_attention_heads, cfg.head_dim)
        k = k.view(b, t, cfg.num_key_value_heads, cfg.head_dim)
        v = v.view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = (rope_qk_tables_fused if fused else rope_qk_tables)(q, k, *rope)
            return q.transpose(1, 2), k.transpose(1, 2), v
        q, k = rope_qk(q.transpose(1, 2), k.transpose(1, 2), position_ids, cfg.rope_theta)
        return q, k, v

    def mla_qkv(self, x: torch.Tensor, position_ids: torch.Tensor | None, fused: bool,
                rope: tuple[torch.Tensor, torch.Tensor] | None, steps: StepWeights | None):
        """qkv for MLA: q [B, nh, T, nope+rope], k the same, v [B, nh, T, v_head_dim]; RoPE on the rope parts."""
        cfg, att = self.cfg, self.self_attn
        b, t, _ = x.shape
        nh, nope, rd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q_a, kv_a = project_each((att.q_a_proj, att.kv_a_proj_with_mqa), x, steps)
        q = project(att.q_b_proj, att.q_a_layernorm(q_a, fused), steps).view(b, t, nh, cfg.head_dim)
        latent, k_pe = kv_a.split([cfg.kv_lora_rank, rd], dim=-1)
        kv = project(att.kv_b_proj, att.kv_a_layernorm(latent, fused), steps).view(b, t, nh, nope + cfg.v_head_dim)
        k_nope, v = kv.split([nope, cfg.v_head_dim], dim=-1)
        q_nope, q_pe = q.split([nope, rd], dim=-1)
        q_pe, k_pe = interleaved_to_halves(q_pe), interleaved_to_halves(k_pe).unsqueeze(2)  # k_pe [B, T, 1, rd]
        if rope is not None:
            q_pe, k_pe = (rope_qk_tables_fused if fused else rope_qk_tables)(q_pe, k_pe, *rope)
        else:
            q_pe, k_pe = rope_qk(q_pe.transpose(1, 2), k_pe.transpose(1, 2), position_ids, cfg.rope_theta)
            q_pe, k_pe = q_pe.transpose(1, 2), k_pe.transpose(1, 2)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, t, nh, rd)], dim=-1)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor, fused: bool = False) -> torch.Tensor:
        args = (embeds, hidden, self.input_layernorm.weight, self.hidden_norm.weight, self.cfg.rms_norm_eps)
        if fused:
            return norm_pair_cat_fused(*args, matmul_dtype(hidden))
        return norm_pair_cat(*args)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor, fused: bool = False,
               steps: StepWeights | None = None) -> torch.Tensor:
        """attn [B, nh, T, hd] -> the new residual stream [B, T, H]; the residual is the incoming hidden."""
        b, _, t, _ = attn.shape
        h = hidden + project(self.self_attn.o_proj, attn.transpose(1, 2).reshape(b, t, -1), steps)
        return h + self.mlp(recomputed(self.post_attention_layernorm, h, fused), fused, steps)


class DrafterCache:
    """Append-only key/value cache of the draft layer; crop(length) rolls back rejected draft tokens."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a drafter cache of length {self.length} to {length}")
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 head; parameter names are the SGLang/EAGLE checkpoint keys (fc, midlayer.*, norm, lm_head)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # copied from the target, never trained
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.reset_parameters()

    # ---- construction -------------------------------------------------------------------------------
    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        nn.init.normal_(self.embed_tokens.weight, std=std)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary map (from draftline.drafter.vocab)."""
        cfg = self.config
        if d2t.shape != (cfg.draft_vocab_size,) or t2d.shape != (cfg.vocab_size,):
            raise ConfigError(
                f"vocabulary map has d2t {tuple(d2t.shape)} and t2d {tuple(t2d.shape)}, but the drafter needs "
                f"({cfg.draft_vocab_size},) and ({cfg.vocab_size},); rebuild it with the drafter's sizes"
            )
        used = torch.arange(cfg.draft_vocab_size) + d2t.long().cpu()
        if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d.cpu()[used].all()):
            raise ConfigError("d2t and t2d disagree (t2d must be True exactly at the target ids d2t maps to); rebuild the vocabulary")
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    def load_target_weights(self, embed_tokens: torch.Tensor) -> None:
        """Copy the target's input embeddings (frozen)."""
        if tuple(embed_tokens.shape) != tuple(self.embed_tokens.weight.shape):
            raise ConfigError(
                f"target embed_tokens has shape {tuple(embed_tokens.shape)} but the drafter expects "
                f"{tuple(self.embed_tokens.weight.shape)}; the drafter's hidden_size must equal the target's "
                "to share its embeddings"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_tokens)

    # ---- vocabulary ----------------------------------------------------------------------------------
    @property
    def draft_token_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, ascending, [Vd]."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ---- decode-time forward -----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                cache: DrafterCache | None = None):
        """One call over T new slots: hidden of slot t with the embedding of input_ids[t] (the NEXT token).

        hidden is fc(aux) for real target positions or a previous hidden_out for draft steps; the queries
        attend causally to the cache plus the new slots. Returns (draft_logits, hidden_out, cache).
        """
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        q, k, v = self.midlayer.qkv(embeds, hidden, position_ids)
        past = 0 if cache is None else cache.length
        if cache is not None:
            k, v = cache.append(k, v)
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        t, s = q.shape[2], k.shape[2]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=past)
        attn = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask)
        hidden_out = self.midlayer.finish(hidden, attn)
        logits = self.lm_head(self.norm(hidden_out))
        return logits, hidden_out, cache
