"""The training-time-test graph: k unrolled draft steps, their causal-plus-diagonal attention, and the chunked soft loss."""
from __future__ import annotations

import torch
from torch import nn

from draftline.drafter.model import Eagle3Drafter, repeat_kv


# ---- training-time-test attention ----------------------------------------------------------------------------
def ttt_attention_eager(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], doc_ids: torch.Tensor) -> torch.Tensor:
    """Step j's queries over step-0 keys (causal, same sequence) and the diagonal key of each later step.

    q [R, nh, T, hd]; ks/vs: one [R, nkv, T, hd] per step so far; doc_ids [R, T]. Exact, O(T^2) memory.
    """
    groups = q.shape[1] // ks[0].shape[1]
    t = q.shape[2]
    scale = q.shape[-1] ** -0.5
    k0, v0 = repeat_kv(ks[0], groups), repeat_kv(vs[0], groups)
    allowed = torch.ones(t, t, dtype=torch.bool, device=q.device).tril() & (doc_ids[:, :, None] == doc_ids[:, None, :])
    scores = [torch.matmul(q, k0.transpose(-1, -2)).mul(scale).masked_fill(~allowed[:, None], float("-inf"))]
    for k in ks[1:]:
        scores.append((q * repeat_kv(k, groups)).sum(-1, keepdim=True).mul(scale))
    probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :t], v0)
    for i, v in enumerate(vs[1:]):
        out = out + probs[..., t + i: t + i + 1] * repeat_kv(v, groups)
    return out


_FLEX = None


def ttt_attention_flex(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], doc_ids: torch.Tensor) -> torch.Tensor:
    """The same attention as ttt_attention_eager through compiled flex attention: only unmasked blocks are computed."""
    global _FLEX
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False) if q.is_cuda else flex_attention
    r, _, t, _ = q.shape
    steps = len(ks)

    def mask_mod(b, h, qi, kv):
        block, s = kv // t, kv % t
        causal = (block == 0) & (s <= qi) & (doc_ids[b, s] == doc_ids[b, qi])
        return causal | ((block > 0) & (s == qi))

    block_mask = create_block_mask(mask_mod, r, None, t, steps * t, device=q.device)
    groups = q.shape[1] // ks[0].shape[1]
    return _FLEX(q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), block_mask=block_mask, enable_gqa=groups > 1)


# ---- loss -------------------------------------------------------------------------------------------------------
class SoftCrossEntropy(torch.autograd.Function):
    """sum_rows CE(target_probs, softmax(x @ weight.T)) in row chunks, never holding all logits in fp32.

    The gradient (softmax - p) is formed chunk by chunk in the forward and kept in the compute dtype, so the
    backward is two matmuls and the fp32 logits/log-softmax of every row never exist at once.
    """

    @staticmethod
    def forward(ctx, x, weight, target_probs, chunk: int):
        rows = x.shape[0]
        acc = torch.promote_types(x.dtype, torch.float32)
        total = torch.zeros((), dtype=acc, device=x.device)
        preds = torch.empty(rows, dtype=torch.long, device=x.device)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        coeff = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device) if need_grad else None
        for a in range(0, rows, chunk):
            z = torch.matmul(x[a:a + chunk], weight.t()).to(acc)
            p = target_probs[a:a + chunk].to(acc)
            lse = torch.logsumexp(z, dim=-1)
            total += (lse * p.sum(-1) - (p * z).sum(-1)).sum()
            preds[a:a + chunk] = z.argmax(-1)
            if need_grad:
                coeff[a:a + chunk] = (torch.softmax(z, dim=-1) - p).to(x.dtype)
        ctx.save_for_backward(x, weight, coeff)
        ctx.mark_non_differentiable(preds)
        return total, preds

    @staticmethod
    def backward(ctx, grad_total, _grad_preds):
        x, weight, coeff = ctx.saved_tensors
        g = coeff * grad_total.to(coeff.dtype)
        grad_x = torch.matmul(g, weight) if ctx.needs_input_grad[0] else None
        grad_w = torch.matmul(g.t(), x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None


@torch.no_grad()
def target_distribution(last: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor,
                        chunk: int, dtype: torch.dtype):
    """From final hidden states [N, Ht]: the target's distribution renormalised over the draft vocabulary [N, Vd]
    (kept in `dtype`), whether its argmax lies in the draft vocabulary [N], and that argmax [N].

    Logits are formed `chunk` rows at a time, so [N x target vocab] never exists at once.
    """
    n = last.shape[0]
    probs = torch.empty(n, draft_ids.numel(), dtype=dtype, device=last.device)
    argmax = torch.empty(n, dtype=torch.long, device=last.device)
    w = lm_head.to(dtype)
    for a in range(0, n, chunk):
        z = torch.matmul(last[a:a + chunk].to(dtype), w.t())
        argmax[a:a + chunk] = z.argmax(-1)
        probs[a:a + chunk] = torch.softmax(z.index_select(1, draft_ids).float(), dim=-1).to(dtype)
    return probs, t2d[argmax], argmax


class TTTModel(nn.Module):
    """The drafter unrolled for k steps of training-time test; forward returns per-step sums (loss, counts, hits)."""

    def __init__(self, drafter: Eagle3Drafter, lm_head: torch.Tensor, steps: int, chunk: int, attention: str,
                 compute_dtype: torch.dtype):
        super().__init__()
        self.drafter = drafter
        self.target_lm_head = lm_head  # a plain attribute: frozen, never broadcast or saved with the drafter
        self.steps, self.chunk, self.compute_dtype = steps, chunk, compute_dtype
        self.attention = ttt_attention_flex if attention == "flex" else ttt_attention_eager

    def unroll(self, input_ids, doc_ids, position_ids, aux):
        """Yield the drafter's residual stream [R, T, H] after each of the k steps.

        Step j at slot t reads the token t+1+j and (j > 0) its own step j-1 output at t, at position t+j: the
        chain an engine drafts after accepting token t+1, so training sees what decoding will feed it.
        """
        m = self.drafter
        t = input_ids.shape[1]
        hidden = m.fc(aux.to(self.compute_dtype))
        ks, vs = [], []
        for j in range(self.steps):
            shift = 1 + j
            tokens = torch.zeros_like(input_ids)
            tokens[:, : max(0, t - shift)] = input_ids[:, shift:]
            q, k, v = m.midlayer.qkv(m.embed_tokens(tokens).to(hidden.dtype), hidden, position_ids + j)
            ks.append(k)
            vs.append(v)
            hidden = m.midlayer.finish(hidden, self.attention(q, ks, vs, doc_ids))
            yield hidden

    def forward(self, input_ids, loss_mask, doc_ids, position_ids, aux, last):
        m = self.drafter
        r, t = input_ids.shape
        dt = self.compute_dtype
        probs, in_vocab, target_argmax = target_distribution(
            last.reshape(r * t, -1), self.target_lm_head, m.draft_token_ids, m.t2d, self.chunk, dt)
        loss_sums, counts, hits, totals = [], [], [], []
        lm_w = m.lm_head.weight.to(dt)
        for j, hidden in enumerate(self.unroll(input_ids, doc_ids, position_ids, aux)):
            shift = 1 + j
            # Slot t at step j predicts token t+2+j from the target's distribution at t+1+j, inside one sequence.
            lossable = torch.zeros_like(loss_mask)
            if t > shift + 1:
                lossable[:, : t - shift - 1] = ((doc_ids[:, shift + 1:] == doc_ids[:, : t - shift - 1])
                                                & (doc_ids[:, : t - shift - 1] >= 0) & loss_mask[:, shift + 1:])
            slots = lossable.reshape(-1).nonzero().squeeze(1)
            src = slots + shift
            keep = in_vocab[src]
            rows, src = slots[keep], src[keep]
            x = m.norm(hidden).reshape(r * t, -1).index_select(0, rows).to(dt)
            loss_sum, preds = SoftCrossEntropy.apply(x, lm_w, probs.index_select(0, src), self.chunk)
            loss_sums.append(loss_sum)
            counts.append(rows.numel())
            hits.append((m.draft_to_target(preds) == target_argmax[src]).sum())
            totals.append(slots.numel())
        dev = input_ids.device
        return (torch.stack(loss_sums), torch.tensor(counts, device=dev, dtype=torch.float32),
                torch.stack(hits).float(), torch.tensor(totals, device=dev, dtype=torch.float32))


def acceptance_length(acc: list[float]) -> float:
    """Offline estimate of mean acceptance length: 1 + sum_j prod_{i<=j} acc_i (the reference decoder's definition)."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total
