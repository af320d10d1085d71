"""The training-time-test graph: k unrolled draft steps, their causal-plus-diagonal attention, and the chunked soft loss."""
from __future__ import annotations

from typing import Iterable, NamedTuple

import torch
from torch import nn

from draftline.drafter.model import Eagle3Drafter, repeat_kv, rope_tables
from draftline.drafter.speed import SharedWeightGrad, StepWeights, compiled_on_device, recomputed


# ---- training-time-test attention ----------------------------------------------------------------------------
def ttt_attention_eager(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], doc_ids: torch.Tensor,
                        total_steps: int | None = None, block_mask=None) -> torch.Tensor:
    """Step j's queries over step-0 keys (causal, same sequence) and the diagonal key of each later step.

    q [R, nh, T, hd]; ks/vs: one [R, nkv, T, hd] per step so far; doc_ids [R, T], -1 for padding, which attends
    to itself only (so a batch padded to a fixed length costs no attention between padding). Exact, O(T^2) memory.
    total_steps (the unroll's length) and block_mask matter only to the flex version.
    """
    groups = q.shape[1] // ks[0].shape[1]
    t = q.shape[2]
    scale = q.shape[-1] ** -0.5
    k0, v0 = repeat_kv(ks[0], groups), repeat_kv(vs[0], groups)
    same_doc = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, :, None] >= 0)
    allowed = torch.ones(t, t, dtype=torch.bool, device=q.device).tril() & same_doc
    allowed |= torch.eye(t, dtype=torch.bool, device=q.device)  # padding (doc id -1) attends to itself only
    scores = [torch.matmul(q, k0.transpose(-1, -2)).mul(scale).masked_fill(~allowed[:, None], float("-inf"))]
    for k in ks[1:]:
        scores.append((q * repeat_kv(k, groups)).sum(-1, keepdim=True).mul(scale))
    probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :t], v0)
    for i, v in enumerate(vs[1:]):
        out = out + probs[..., t + i: t + i + 1] * repeat_kv(v, groups)
    return out


def ttt_block_masks(doc_ids: torch.Tensor, key_steps: int, runs: Iterable[int] | None = None, block: int = 128) -> list:
    """The flex BlockMasks of the TTT mask for unrolls of each length in `runs` (default 1..key_steps), over keys of
    key_steps steps of length T (those of steps past a run's length left out), built from block-level doc ranges.

    create_block_mask would evaluate mask_mod densely over [R, T, steps*T] under vmap at every step, which costs
    milliseconds of host time per call while the GPU waits. Here: a query block meets a step-0 key block when it is
    not in the future and their doc-id ranges overlap (a superset of the blocks with an allowed pair, which is all
    correctness needs: mask_mod still decides each element) or is its diagonal block; a block is full (mask_mod
    skipped) only when it lies strictly below the diagonal and both blocks hold one and the same doc id and no
    padding. Each later step adds the one or two key blocks holding its diagonal. All runs share that work and are
    built by one batch of device ops: in training the host issues them while the device computes, instead of
    issuing a few dozen small kernels per step while the device waits.
    """
    from torch.nn.attention.flex_attention import BlockMask

    runs = list(runs) if runs is not None else list(range(1, key_steps + 1))
    if not runs or min(runs) < 1 or max(runs) > key_steps:
        raise ValueError(f"runs {runs} must lie in 1..key_steps={key_steps}")
    dev = doc_ids.device
    r, t = doc_ids.shape
    n_q, n_kv = -(-t // block), -(-key_steps * t // block)
    # Doc-id ranges over each block's real positions (padding, -1, and the tail past T left out): a block of
    # padding only has an empty range (lo > hi) and meets no other block; its diagonal block is always kept.
    padded = torch.cat([doc_ids, doc_ids.new_full((r, n_q * block - t), -1)], dim=1).view(r, n_q, block)
    real = padded >= 0
    lo = torch.where(real, padded, torch.iinfo(padded.dtype).max).amin(-1)  # [R, n_q]
    hi = padded.amax(-1)
    qb = torch.arange(n_q, device=dev)
    past = qb[None, :] <= qb[:, None]  # [query block, key block]
    diagonal = qb[None, :] == qb[:, None]
    overlap = ((lo[:, :, None] <= hi[:, None, :]) & (hi[:, :, None] >= lo[:, None, :]) & past) | diagonal
    pure = real.all(-1) & (lo == hi)  # one doc, no padding
    full = (pure[:, :, None] & pure[:, None, :] & (lo[:, :, None] == lo[:, None, :])
            & (qb[None, :] < qb[:, None]))
    base = torch.zeros(r, n_q, n_kv, dtype=torch.bool, device=dev)
    base[:, :, :n_q] = overlap & ~full
    full_kv = torch.zeros_like(base)
    full_kv[:, :, :n_q] = full
    longest = max(runs)
    later = torch.zeros(longest, n_q, n_kv, dtype=torch.bool, device=dev)  # [i]: step i's diagonal key blocks
    if longest > 1:  # for query block q: the key blocks of its first and last query, shifted by i*T
        steps = torch.arange(1, longest, device=dev)[:, None]
        first, last = qb * block, (qb * block + block).clamp(max=t) - 1
        # Indices and value on the device: a host-built index or a Python True is copied over with a wait for the
        # device, and the device then idles while the host launches the next small kernels.
        present = torch.ones((), dtype=torch.bool, device=dev)
        for pos in (first, last):
            later[steps.expand(-1, n_q), qb.expand(longest - 1, -1), (steps * t + pos) // block] = present
    upto = later.cumsum(0, dtype=torch.int32) > 0  # [i]: the diagonal blocks of steps 1..i
    # Python ints pick views: a host-built index tensor would be copied over with a wait for the device.
    partial = base[None] | torch.stack([upto[n - 1] for n in runs])[:, None]

    def ordered(dense):  # (count per query block, key-block indices with the present ones first, ascending)
        # Contiguous: flex attention's kernels step through the indices as if they were (a transposed dense mask
        # sorts into strided ones, and the backward then reads the wrong blocks).
        order = torch.sort((~dense).to(torch.int16), dim=-1, stable=True).indices
        return (dense.sum(-1, dtype=torch.int32).unsqueeze(-2),
                order.to(torch.int32, memory_format=torch.contiguous_format).unsqueeze(-3).contiguous())

    num, idx = ordered(partial)  # [runs, R, 1, n_q], [runs, R, 1, n_q, n_kv]
    full_num, full_idx = ordered(full_kv)
    # The backward's view (query blocks per key block) from the same dense masks, transposed: from_kv_blocks would
    # rebuild each dense mask from the indices under a nested vmap, about 1 ms of host time per mask.
    q_num, q_idx = ordered(partial.transpose(-1, -2))
    full_q_num, full_q_idx = ordered(full_kv.transpose(-1, -2))
    return [BlockMask(seq_lengths=(t, key_steps * t), kv_num_blocks=num[i], kv_indices=idx[i],
                      full_kv_num_blocks=full_num, full_kv_indices=full_idx, q_num_blocks=q_num[i],
                      q_indices=q_idx[i], full_q_num_blocks=full_q_num, full_q_indices=full_q_idx,
                      BLOCK_SIZE=(block, block), mask_mod=ttt_mask_mod(doc_ids, torch.full((), n, device=dev)))
            for i, n in enumerate(runs)]


def ttt_mask_mod(doc_ids: torch.Tensor, steps: torch.Tensor | None = None):
    """Element mask of the TTT attention: key kv in block kv // T is step-0's causal same-doc key or a diagonal.

    steps (a 0-d device tensor, so that its value is data and not a constant compiled into the kernel): keys in
    blocks from `steps` on belong to steps not run yet and are masked."""
    t = doc_ids.shape[1]

    def mask_mod(b, h, qi, kv):
        block, s = kv // t, kv % t
        causal = (block == 0) & (s <= qi) & (doc_ids[b, s] == doc_ids[b, qi]) & (doc_ids[b, qi] >= 0)
        diagonal = s == qi  # every step's diagonal (step 0's: padding attends to itself only)
        if steps is not None:
            diagonal = diagonal & (block < steps)
        return causal | diagonal

    return mask_mod


_FLEX = None
# torch.compile's mode for flex attention. "max-autotune-no-cudagraphs" lets inductor time its candidate block sizes
# for the forward and backward kernels on the first call (minutes of compiling); None keeps its defaults.
FLEX_COMPILE_MODE: str | None = None


def ttt_attention_flex(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], doc_ids: torch.Tensor,
                       total_steps: int | None = None, block_mask=None) -> torch.Tensor:
    """The same attention as ttt_attention_eager through compiled flex attention: only unmasked blocks are computed.

    With total_steps, the keys of steps not run yet are zeros that the block mask leaves out, so every step of the
    unroll has one shape. Compiled flex attention recompiles for every new key length and gives up after
    torch._dynamo's recompile limit (8): with k = 7, training and validation alone would need 14 variants.
    block_mask: this step's, from ttt_block_masks (built here when not given)."""
    run = len(ks)
    total = max(run, total_steps or run)
    if total > run:
        blank = torch.zeros_like(ks[0])
        ks, vs = ks + [blank] * (total - run), vs + [blank] * (total - run)
    if block_mask is None:
        block_mask = ttt_block_masks(doc_ids, total, [run])[0]
    return flex_step_attention(q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), block_mask)


def flex_step_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_mask) -> torch.Tensor:
    """Compiled flex attention of one TTT step's queries over every step's keys and values [B, nkv, k*T, hd]."""
    global _FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False, mode=FLEX_COMPILE_MODE) if q.is_cuda else flex_attention
    # Batches still differ in rows (packing) and in grad mode (validation): a few more variants than dynamo's
    # default limit of 8 allows; past the limit it silently falls back to unfused flex attention, far slower.
    with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
        return _FLEX(q, keys, values, block_mask=block_mask, enable_gqa=q.shape[1] > keys.shape[1])


class _StepSlots(torch.autograd.Function):
    """Step j's view of every unrolled step's keys (or values) in one buffer [B, nkv, k*T, hd]: only step j's own
    are written, into their slot. Its gradient goes back to each step's tensor as a view of that step's slot.

    The write goes through `.data`, out of autograd's version tracking, because earlier steps' attention saved the
    same buffer for its backward. That is safe because each step's block mask leaves out the slots of later steps,
    so no backward reads what a later step wrote (benchmarks/probes/ttt_gradients.py checks it on a GPU)."""

    @staticmethod
    def forward(ctx, slots: "StepSlots", *parts):
        j, t = len(parts) - 1, parts[-1].shape[2]
        slots.buffer.data[:, :, j * t:(j + 1) * t].copy_(parts[-1])
        ctx.t, ctx.n = t, len(parts)
        return slots.buffer.detach()

    @staticmethod
    def backward(ctx, grad):
        t = ctx.t
        return (None, *(grad[:, :, i * t:(i + 1) * t] for i in range(ctx.n)))


class StepSlots:
    """One buffer for the keys (or the values) of all k unrolled steps, filled step by step (see _StepSlots).
    The alternative, a cat of every step's keys and zeros per step, copies k x T keys at each of the k steps."""

    def __init__(self, steps: int):
        self.steps, self.parts, self.buffer = steps, [], None

    def add(self, x: torch.Tensor) -> torch.Tensor:
        """Put step j's x [B, nkv, T, hd] into slot j; return the whole buffer as step j's attention sees it."""
        if self.buffer is None:
            b, h, t, d = x.shape
            self.buffer = x.new_zeros(b, h, self.steps * t, d)
        self.parts.append(x)
        return _StepSlots.apply(self, *self.parts)


# ---- loss -------------------------------------------------------------------------------------------------------
def soft_ce_chunk(z: torch.Tensor, p: torch.Tensor, grad_out: torch.Tensor | None = None,
                  row_weight: torch.Tensor | None = None):
    """For logits z and target probabilities p [n, V]: sum of the rows' soft cross-entropy (each times its
    row_weight [n], when given) and each row's argmax; with grad_out, the loss's gradient wrt z, (softmax(z) - p)
    times the row's weight, written into it (in its dtype). In fp32 (or z's wider dtype) inside. Written into, not
    returned: compiled, the kernel stores straight into the caller's buffer instead of a new tensor copied there."""
    acc = torch.promote_types(z.dtype, torch.float32)
    z, p = z.to(acc), p.to(acc)
    lse = torch.logsumexp(z, dim=-1)
    per_row = lse * p.sum(-1) - (p * z).sum(-1)
    if row_weight is not None:
        per_row = per_row * row_weight.to(acc)
    if grad_out is not None:
        grad = torch.exp(z - lse[:, None]) - p
        grad_out.copy_(grad if row_weight is None else grad * row_weight.to(acc)[:, None])
    return per_row.sum(), z.argmax(-1)


# On CUDA one pass over z and p and one write of the gradient, where eager PyTorch makes about ten passes over fp32
# [n x V] copies (the largest elementwise cost of a training step in an H200 profile).
soft_ce_chunk_fused = compiled_on_device(soft_ce_chunk)


class SoftCrossEntropy(torch.autograd.Function):
    """sum_rows row_weight x CE(target_probs, softmax(x @ weight.T)) in row chunks, never holding all logits in fp32.

    The gradient (softmax - p) is formed chunk by chunk in the forward and kept in the compute dtype, so the
    backward is two matmuls and the fp32 logits/log-softmax of every row never exist at once. row_weight [n]
    (0 or 1 in training: whether the row's target lies in the draft vocabulary) drops rows from the loss without
    a device-to-host wait to find them.
    """

    @staticmethod
    def forward(ctx, x, weight, target_probs, chunk: int, shared: SharedWeightGrad | None = None,
                row_weight: torch.Tensor | None = None):
        rows = x.shape[0]
        acc = torch.promote_types(x.dtype, torch.float32)
        total = torch.zeros((), dtype=acc, device=x.device)
        preds = torch.empty(rows, dtype=torch.long, device=x.device)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        coeff = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device) if need_grad else None
        for a in range(0, rows, chunk):
            part, preds[a:a + chunk] = soft_ce_chunk_fused(torch.matmul(x[a:a + chunk], weight.t()),
                                                           target_probs[a:a + chunk],
                                                           coeff[a:a + chunk] if need_grad else None,
                                                           None if row_weight is None else row_weight[a:a + chunk])
            total += part
        ctx.save_for_backward(x, weight, coeff)
        ctx.shared = shared  # the weight's gradient summed in place over the TTT steps
        ctx.mark_non_differentiable(preds)
        return total, preds

    @staticmethod
    def backward(ctx, grad_total, _grad_preds):
        x, weight, coeff = ctx.saved_tensors
        scale = grad_total.to(coeff.dtype)  # applied to the [n x H] sides: coeff [n x V] is the largest tensor here
        grad_x = torch.matmul(coeff, weight).mul_(scale) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (ctx.shared or SharedWeightGrad()).add(coeff.t(), x * scale)
        return grad_x, grad_w, None, None, None, None


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


class LossPlan(NamedTuple):
    """Which slots enter each TTT step's loss, from the batch's loss mask and doc ids alone (no target needed), so
    it can be made on the host beside the batch: slots[j] [n_j] (flat, ascending) and lossable [k] (the n_j)."""
    slots: list[torch.Tensor]
    lossable: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> "LossPlan":
        return LossPlan([s.to(device, non_blocking=non_blocking) for s in self.slots],
                        self.lossable.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "LossPlan":
        return LossPlan([s.pin_memory() for s in self.slots], self.lossable.pin_memory())


def loss_plan(loss_mask: torch.Tensor, doc_ids: torch.Tensor, steps: int) -> LossPlan:
    """The LossPlan of a batch [R, T] for an unroll of `steps`. Slot t at step j predicts token t+2+j from the
    target's distribution at t+1+j: it is lossable when that token is in the loss and in the same sequence.
    On the host (CPU tensors) it costs the device nothing; on the device it waits for it once (nonzero)."""
    r, t = loss_mask.shape

    def ahead(x, fill, first):  # [k, R, T]: x[:, s + first + j] at step j, `fill` past the end (views of one cat)
        windows = torch.cat([x, x.new_full((r, steps + 2), fill)], dim=1).unfold(1, t, 1)
        return windows[:, first:first + steps].transpose(0, 1)

    lossable = ((ahead(doc_ids, -1, 2) == doc_ids) & (doc_ids >= 0) & ahead(loss_mask.bool(), False, 2))
    lossable = lossable.reshape(steps, r * t)
    slot = lossable.nonzero()[:, 1]  # step-major, ascending slots within a step
    counts = lossable.sum(1)
    return LossPlan(list(slot.split(counts.tolist())), counts)


class TTTModel(nn.Module):
    """The drafter unrolled for k steps of training-time test; forward returns per-step sums (loss, counts, hits)."""

    def __init__(self, drafter: Eagle3Drafter, lm_head: torch.Tensor, steps: int, chunk: int, attention: str,
                 compute_dtype: torch.dtype, one_key_shape: bool = True, key_slots: bool | None = None):
        super().__init__()
        self.drafter = drafter
        embeddings = drafter.embed_tokens.weight
        if not embeddings.requires_grad and embeddings.dtype.itemsize > compute_dtype.itemsize:
            # Frozen and only ever read through a cast to the compute dtype: holding it there gives the same
            # values in half the memory (a 128k x 4096 table is 2.1 GB in fp32).
            drafter.embed_tokens.to(compute_dtype)
        self.target_lm_head = lm_head  # a plain attribute: frozen, never broadcast or saved with the drafter
        self.steps, self.chunk, self.compute_dtype = steps, chunk, compute_dtype
        # The loss over the draft vocabulary takes as many logits per chunk as the target's lm_head does: more rows
        # for a smaller vocabulary (4x at 32k of 128k), so fewer kernel calls for the same memory.
        cfg = drafter.config
        self.draft_chunk = max(chunk, chunk * cfg.vocab_size // cfg.draft_vocab_size)
        self.attention = ttt_attention_flex if attention == "flex" else ttt_attention_eager
        # False: each step's keys only (k key lengths, k compiled flex kernels); benchmarks/train.py compares both.
        self.one_key_shape = one_key_shape
        # True: all steps' keys and values in one buffer each (StepSlots) instead of a cat per step. None: on the flex
        # path only, where benchmarks/train.py measures it as fast and leaner on an H200 (MFU 0.650 against 0.649, 16.0
        # against 16.7 GB: benchmarks/RESULTS.md); the eager path keeps the cat.
        if key_slots is None:
            key_slots = attention == "flex"
        self.key_slots = key_slots and one_key_shape

    def unroll(self, input_ids, doc_ids, position_ids, aux, steps: StepWeights | None = None):
        """Yield the drafter's residual stream [R, T, H] after each of the k steps.

        Step j at slot t reads the token t+1+j and (j > 0) its own step j-1 output at t, at position t+j: the
        chain an engine drafts after accepting token t+1, so training sees what decoding will feed it.
        """
        m = self.drafter
        t = input_ids.shape[1]
        # Every step's block mask up front, in one batch of device ops queued behind the work already issued.
        masks = (ttt_block_masks(doc_ids, self.steps)
                 if self.attention is ttt_attention_flex and self.one_key_shape else [None] * self.steps)
        hidden = m.fc(aux.to(self.compute_dtype))
        cos, sin = rope_tables(position_ids, self.steps, m.config.rope_dim, m.config.rope_theta, hidden.dtype)
        # Every step's input embeddings in one lookup [k, R, T, H]: step j reads token t+1+j, 0 past the end.
        padded = torch.cat([input_ids, input_ids.new_zeros(input_ids.shape[0], self.steps)], dim=1)
        embeds = m.embed_tokens(padded.unfold(1, t, 1)[:, 1:self.steps + 1].transpose(0, 1)).to(hidden.dtype)
        ks, vs = [], []
        slots = (StepSlots(self.steps), StepSlots(self.steps)) if self.key_slots else None
        for j in range(self.steps):
            q, k, v = m.midlayer.qkv(embeds[j], hidden, None, fused=True, rope=(cos[j], sin[j]), steps=steps)
            if slots is None:
                ks.append(k)
                vs.append(v)
                attn = self.attention(q, ks, vs, doc_ids, self.steps if self.one_key_shape else None, masks[j])
            else:
                keys, values = slots[0].add(k), slots[1].add(v)
                if self.attention is ttt_attention_flex:
                    attn = flex_step_attention(q, keys, values, masks[j])
                else:  # the exact attention over the same slots: what the CPU tests check the slots with
                    per_step = [slice(i * t, (i + 1) * t) for i in range(j + 1)]
                    attn = ttt_attention_eager(q, [keys[:, :, s] for s in per_step], [values[:, :, s] for s in per_step],
                                               doc_ids)
            hidden = m.midlayer.finish(hidden, attn, fused=True, steps=steps)
            yield hidden

    def loss_input(self, hidden, rows):
        """The final norm of the rows that enter the loss, in the compute dtype [n, H]."""
        normed = self.drafter.norm(hidden, fused=True)
        return normed.reshape(-1, hidden.shape[-1]).index_select(0, rows).to(self.compute_dtype)

    def forward(self, input_ids, loss_mask, doc_ids, position_ids, aux, last, plan: LossPlan | None = None):
        """Per step: (loss sum, rows in the loss, top-1 hits, lossable rows), over the lossable slots whose target
        token lies in the draft vocabulary. plan: loss_plan(loss_mask, doc_ids, k) made on the host and copied
        over; without it, it is made here, after step 0 is queued, with one wait for the device."""
        m = self.drafter
        r, t = input_ids.shape
        dt = self.compute_dtype
        probs, in_vocab, target_argmax = target_distribution(
            last.reshape(r * t, -1), self.target_lm_head, m.draft_token_ids, m.t2d, self.chunk, dt)
        loss_sums, counts, hits = [], [], []
        steps = StepWeights()
        lm_w, lm_grad = steps.weight(m.lm_head, dt)
        for j, hidden in enumerate(self.unroll(input_ids, doc_ids, position_ids, aux, steps)):
            if plan is None:  # after step 0 is queued, so the device stays busy while the host waits
                plan = loss_plan(loss_mask, doc_ids, self.steps)
            rows = plan.slots[j]
            src = rows + 1 + j  # where the target's distribution for each row's prediction was computed
            # A row whose target lies outside the draft vocabulary stays in the matmuls with weight 0: finding and
            # dropping it would need the device's answer on the host, and the device would idle meanwhile.
            keep = in_vocab.index_select(0, src)
            # Recomputed in backward from the bf16 hidden instead of keeping the norm's fp32 intermediates.
            x = recomputed(self.loss_input, hidden, rows)
            loss_sum, preds = SoftCrossEntropy.apply(x, lm_w, probs.index_select(0, src), self.draft_chunk, lm_grad,
                                                     keep)
            loss_sums.append(loss_sum)
            counts.append(keep.sum())
            # A target outside the draft vocabulary is never hit: the drafter predicts inside it.
            hits.append((m.draft_to_target(preds) == target_argmax.index_select(0, src)).sum())
        return torch.stack(loss_sums), torch.stack(counts).float(), torch.stack(hits).float(), plan.lossable.float()


def acceptance_length(acc: list[float]) -> float:
    """Offline estimate of mean acceptance length: 1 + sum_j prod_{i<=j} acc_i (the reference decoder's definition)."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total
