"""Target and drafter forwards over a ragged batch (rejected slots kept as masked cache holes), and each row's output.

Rows advance by different amounts; rejected positions stay in the KV caches as masked holes and each row keeps its
own RoPE positions, so rows never wait for each other. This is the eager path's machinery; draftline.decode_static
holds the preallocated, fixed-shape counterpart.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from draftline.errors import ConfigError
from draftline.target import capture_hidden_states


def attention_bias(key_valid: torch.Tensor, query_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, T, S]: causal over physical slots, holes and padding masked.

    Each query also sees its own slot, so padding queries never have an empty row (which would give NaN
    values that leak into real rows through 0 * NaN).
    """
    b, s = key_valid.shape
    past = s - query_len
    key_pos = torch.arange(s, device=key_valid.device)
    query_pos = past + torch.arange(query_len, device=key_valid.device)
    causal = key_pos[None, :] <= query_pos[:, None]
    allowed = (key_valid[:, None, :] & causal[None]) | (key_pos[None, :] == query_pos[:, None])[None]
    bias = torch.zeros(b, 1, query_len, s, dtype=dtype, device=key_valid.device)
    return bias.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


class RaggedTarget:
    """A transformers causal LM with a KV cache whose slots may be masked, and aux-state capture when asked."""

    def __init__(self, model, aux_layer_ids: list[int] | None):
        self.model = model
        self.aux_layer_ids = aux_layer_ids
        self.cache = None
        self.key_valid: torch.Tensor | None = None  # [B, slots]
        self.forwards = 0

    @property
    def slots(self) -> int:
        return 0 if self.key_valid is None else self.key_valid.shape[1]

    @torch.no_grad()
    def forward(self, input_ids, position_ids, new_valid, last_only: bool = False):
        """Run T new tokens for every row; returns (logits [B,T,V] float32 (T=1 if last_only), aux [B,T,3H] or None)."""
        valid = new_valid if self.key_valid is None else torch.cat([self.key_valid, new_valid], dim=1)
        dtype = next(self.model.parameters()).dtype
        bias = attention_bias(valid, input_ids.shape[1], dtype)
        captured: dict[str, torch.Tensor] = {}
        kwargs = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=bias,
                      past_key_values=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        if self.aux_layer_ids is not None:
            with capture_hidden_states(self.model, self.aux_layer_ids, captured.__setitem__):
                out = self.model(**kwargs)
            aux = torch.cat([captured["aux0"], captured["aux1"], captured["aux2"]], dim=-1)
        else:
            out = self.model(**kwargs)
            aux = None
        self.cache = out.past_key_values
        self.key_valid = valid
        self.forwards += 1
        return out.logits.float(), aux

    def keep(self, slots: int, valid_tail: torch.Tensor | None = None) -> None:
        """Drop slots beyond `slots`; optionally overwrite the validity of the last slots with valid_tail [B, n]."""
        drop = self.slots - slots
        if drop > 0:
            self.cache.crop(-drop)
            self.key_valid = self.key_valid[:, :slots]
        if valid_tail is not None and valid_tail.shape[1]:
            self.key_valid[:, slots - valid_tail.shape[1]:] = valid_tail


class RaggedDrafter:
    """The EAGLE-3 head run over a DrafterCache whose slots may be masked (holes from rejected drafts, padding)."""

    def __init__(self, drafter):
        from draftline.drafter.model import DrafterCache

        self.net = drafter
        self.cache = DrafterCache()
        self.key_valid: torch.Tensor | None = None
        self.forwards = 0

    @property
    def slots(self) -> int:
        return 0 if self.key_valid is None else self.key_valid.shape[1]

    @torch.no_grad()
    def forward(self, input_ids, hidden, position_ids, new_valid):
        """Same computation as Eagle3Drafter.forward, plus a key mask; returns (logits float32, hidden_out)."""
        from draftline.drafter.model import repeat_kv

        net = self.net
        valid = new_valid if self.key_valid is None else torch.cat([self.key_valid, new_valid], dim=1)
        embeds = net.embed_tokens(input_ids).to(hidden.dtype)
        q, k, v = net.midlayer.qkv(embeds, hidden, position_ids)
        k, v = self.cache.append(k, v)
        groups = net.config.num_attention_heads // net.config.num_key_value_heads
        bias = attention_bias(valid, input_ids.shape[1], q.dtype)
        attn = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=bias)
        hidden_out = net.midlayer.finish(hidden, attn)
        logits = net.lm_head(net.norm(hidden_out))
        self.key_valid = valid
        self.forwards += 1
        return logits.float(), hidden_out

    def keep(self, slots: int) -> None:
        if self.slots > slots:
            self.cache.crop(slots)
            self.key_valid = self.key_valid[:, :slots]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, N], valid [B, N], position_ids [B, N]) with prompts right-aligned."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt must have at least one token; drop empty prompts from the prompt set")
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), n), dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, n - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        valid[row, n - len(p):] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    return ids.to(device), valid.to(device), positions.to(device)


def sample_token(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def pick_token(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    if temperature == 0.0:
        return logits.argmax(-1)
    return sample_token(torch.softmax(logits / temperature, dim=-1), generator)


class RowOutputs:
    """Per-row output bookkeeping: emitted tokens, stop at EOS or max_new_tokens."""

    def __init__(self, batch: int, max_new_tokens: int, eos_ids: Sequence[int]):
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.active = [True] * batch
        self.max_new_tokens = max_new_tokens
        self.eos = set(int(e) for e in eos_ids)

    def emit(self, row: int, new: Sequence[int]) -> None:
        for t in new:
            if not self.active[row]:
                return
            self.tokens[row].append(int(t))
            if int(t) in self.eos or len(self.tokens[row]) >= self.max_new_tokens:
                self.active[row] = False

    @property
    def any_active(self) -> bool:
        return any(self.active)


def sync_device(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)

