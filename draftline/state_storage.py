"""How shards store hidden states: bf16 as captured, or fp8 e4m3 with one float32 scale per token and state.

fp8 (extract.storage: fp8-e4m3) halves the bytes per token, so extraction bound by the disk runs up to twice as
fast and shards take half the storage and read traffic. Each state row x (one token, one captured layer) is kept as
q = e4m3(x / s) with s = amax(|x|) / 448, e4m3's largest finite value; readers get back q * s.

Error bound, per element: the scaled value y = x / s lies in [-448, 448]. e4m3 has 3 mantissa bits, so rounding
to nearest moves a normal value (|y| >= 2^-6) by at most half a unit in the last place, 2^-4 |y|, and a subnormal
one by at most half the subnormal spacing 2^-9, i.e. 2^-10. Hence |x - q * s| <= max(2^-4 |x|, 2^-10 s); a reader
that rounds the result to bf16 adds at most 2^-9 of the value (bf16's 8 significant bits).
"""
from __future__ import annotations

import torch

BF16 = "bf16"
FP8_E4M3 = "fp8-e4m3"
STORAGES = (BF16, FP8_E4M3)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Tensor names of the per-row scales beside each fp8 state tensor: [tokens, 3] for the aux states (one per captured
# layer, in slot order) and [tokens, 1] for the last state.
SCALE_SUFFIX = "_scale"
STATE_NAMES = ("aux_hidden_states", "last_hidden_states")


def bytes_per_token(hidden_size: int, storage: str) -> int:
    """Bytes of one token's four states (3 aux + last) and their scales, as stored (without ids and loss mask)."""
    if storage == BF16:
        return 4 * hidden_size * 2
    if storage == FP8_E4M3:
        return 4 * hidden_size + 4 * 4
    raise ValueError(f"unknown state storage {storage!r}; use one of {', '.join(STORAGES)}")


def quantize_rows(rows: torch.Tensor, out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [n, h] (any float dtype) -> (e4m3 [n, h], float32 scales [n, 1]); written into out/scale_out if given.

    An all-zero row gets scale 1 (any scale reproduces it; dividing by zero would not)."""
    x = rows.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # x / scale can round a hair above 448 in float32; e4m3fn has no infinity, so clamp rather than risk NaN.
    q = (x / scale).clamp_(-FP8_MAX, FP8_MAX)
    if out is None:
        out = q.to(FP8_DTYPE)
    else:
        out.copy_(q)
    if scale_out is None:
        scale_out = scale
    else:
        scale_out.copy_(scale)
    return out, scale_out


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q [n, k*h] e4m3 with scale [n, k] (one per h-wide slot) -> [n, k*h] in `dtype`."""
    n, width = q.shape
    slots = scale.shape[-1]
    x = q.float().view(n, slots, width // slots) * scale.float().view(n, slots, 1)
    return x.view(n, width).to(dtype)


def quantize_slots(states: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """states [n, slots*h] -> (e4m3 [n, slots*h], float32 scales [n, slots]): one scale per token and slot."""
    n, width = states.shape
    q, scale = quantize_rows(states.reshape(n * slots, width // slots))
    return q.view(n, width), scale.view(n, slots)
