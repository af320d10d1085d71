"""The offline acceptance estimate that predicts decoding: the reference decoder's draft schedule replayed on
held-out traces with the training unroll.

Validation's per-step accuracies count a draft at every answer position and multiply the steps as if their hits were
independent. Decoding drafts only where the previous round ended (after its accepted tokens and the target's own) and
accepts a draft's leading hits. On the CPU demo the first reads 2.094, the reference decoder 1.983 and this replay
1.955 (benchmarks/RESULTS.md, "Where the offline estimate and decoding part": the independence assumption and the
draft positions move the estimate by x1.10 and x0.85). The traces are the target's greedy answers, so replaying them
teacher-forced is the decode the reference decoder runs, without the target in the loop.
"""
from __future__ import annotations

from typing import Iterable

import torch

from draftline.drafter.data import Sequence
from draftline.drafter.ttt import loss_plan, target_distribution


def draft_hits(ttt, seq: Sequence, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The training unroll over `seq`: (hit [k, t], lossable [k, t], answer). Slot s at step j predicts token s+2+j;
    hit when that is the target's own next token and the slot is in the loss; `answer` indexes the answer's first
    token."""
    m, k, t = ttt.drafter, ttt.steps, len(seq)
    ids, mask = seq.input_ids[None].to(device), seq.loss_mask[None]
    doc, pos = torch.zeros_like(ids), torch.arange(t, device=device)[None]
    _, _, target_next = target_distribution(seq.last.to(device), ttt.target_lm_head, m.draft_token_ids, m.t2d,
                                            ttt.chunk, ttt.compute_dtype)
    target_next = target_next.cpu()
    plan = loss_plan(mask, torch.zeros_like(mask, dtype=torch.long), k)
    lossable = torch.zeros(k, t, dtype=torch.bool)
    hit = torch.zeros(k, t, dtype=torch.bool)
    for j, hidden in enumerate(ttt.unroll(ids, doc, pos, seq.aux[None].to(device))):
        lossable[j, plan.slots[j].cpu()] = True
        # Slot s at step j predicts token s+2+j from the target's distribution at s+1+j.
        src = torch.arange(t) + 1 + j
        ok = src < t
        preds = m.draft_to_target(m.lm_head(m.norm(hidden))[0].argmax(-1)).cpu()
        hit[j, ok] = preds[ok] == target_next[src[ok]]
    answer = int(mask[0].nonzero()[0]) if bool(mask.any()) else t
    return hit & lossable, lossable, answer


def decode_rounds(hit: torch.Tensor, lossable: torch.Tensor, answer: int, limit: int | None = None) -> list[int]:
    """Accepted draft tokens per round when decoding drafts as the reference decoder does: the prefill gives the
    answer's first token, the first draft reads it at slot answer - 1, and each round accepts its leading hits plus
    the target's own token; up to `limit` answer tokens (all of them when None)."""
    k, t = hit.shape
    end = t if limit is None else min(t, answer + limit)
    accepted, slot = [], answer - 1
    while 0 <= slot and slot + 2 < end and bool(lossable[0, slot]):
        n = 0
        while n < k and bool(lossable[n, slot]) and bool(hit[n, slot]):
            n += 1
        accepted.append(n)
        slot += n + 1  # n drafts accepted plus the target's own token
    return accepted


def resampled_acceptance_lengths(per_sequence: list[tuple[int, int]], draws: int = 2000, seed: int = 0) -> torch.Tensor:
    """The pooled mean acceptance length, 1 + accepted / rounds, of `draws` samples of the sequences drawn again with
    replacement, from each sequence's (rounds, accepted draft tokens): how far the figure moves with the sample."""
    x = torch.tensor(per_sequence, dtype=torch.float64).reshape(-1, 2)
    pick = torch.randint(0, len(x), (draws, len(x)), generator=torch.Generator().manual_seed(seed))
    sums = x[pick].sum(1)
    return 1 + sums[:, 1] / sums[:, 0].clamp(min=1)


def resampled_interval(per_sequence: list[tuple[int, int]]) -> list[float] | None:
    """5th and 95th percentile of resampled_acceptance_lengths, None without a round to resample."""
    if not any(n for n, _ in per_sequence):
        return None
    q = torch.quantile(resampled_acceptance_lengths(per_sequence), torch.tensor([0.05, 0.95], dtype=torch.float64))
    return [float(v) for v in q]


def sequence_rounds(ttt, sequences: Iterable[Sequence], device: torch.device, limit: int | None = None
                    ) -> list[list[list[int]]]:
    """Per drafted depth k' (index k' - 1, up to the unroll's depth), per sequence: the accepted draft tokens of each
    round of replaying its answer's first `limit` tokens (decode_rounds)."""
    out: list[list[list[int]]] = [[] for _ in range(ttt.steps)]
    with torch.no_grad():
        for seq in sequences:
            hit, lossable, answer = draft_hits(ttt, seq, device)
            for depth in range(1, ttt.steps + 1):
                out[depth - 1].append(decode_rounds(hit[:depth], lossable[:depth], answer, limit))
    return out


def replayed_acceptance(ttt, sequences: Iterable[Sequence], device: torch.device, limit: int | None = None) -> dict:
    """Mean acceptance length (1 + accepted draft tokens per round) and per-position acceptance over the rounds
    of replaying every sequence's answer (its first `limit` tokens, as a decode of that many new tokens sees it),
    the reference decoder's figures' definitions; `acceptance_length_by_k` replays the same hits drafting only the
    first k' steps, for every k' up to the unroll's depth (an engine drafting fewer tokens than training unrolled
    starts its rounds elsewhere). `interval_by_k`: each figure's 5th-95th percentile over resampled sequences, since
    the estimate predicts decoding on other prompts only as well as these sequences sample them."""
    k = ttt.steps
    by_depth = sequence_rounds(ttt, sequences, device, limit)
    counts = [[n for rounds in depth for n in rounds] for depth in by_depth]
    per_sequence = [[(len(rounds), sum(rounds)) for rounds in depth] for depth in by_depth]
    full = counts[-1]
    rounds = len(full)
    per_position = [sum(n > j for n in full) / rounds if rounds else 0.0 for j in range(k)]
    return {"acceptance_length": 1.0 + sum(full) / rounds if rounds else None, "per_position": per_position,
            "rounds": rounds, "sequences": len(per_sequence[-1]),
            "acceptance_length_by_k": [1.0 + sum(c) / len(c) if c else None for c in counts],
            "interval_by_k": [resampled_interval(c) for c in per_sequence]}


def replayed_summary(replayed: dict) -> str:
    """The log's clause for a replay result: its acceptance length at the unroll's depth and that figure's spread."""
    if not replayed.get("acceptance_length"):
        return ""
    interval = (replayed.get("interval_by_k") or [None])[-1]
    spread = (f" ({interval[0]:.3f}-{interval[1]:.3f} over its {replayed['sequences']} sequences resampled)"
              if interval else "")
    return f", replayed as decoding drafts {replayed['acceptance_length']:.3f}{spread}"
