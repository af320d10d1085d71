"""The draft vocabulary: the N most frequent target tokens among loss-masked (response) tokens, as d2t offsets and a t2d mask."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from draftline.errors import ConfigError


@dataclass
class VocabReport:
    """How the draft vocabulary was chosen, kept with the training run."""

    target_vocab_size: int
    draft_vocab_size: int
    counted_tokens: int  # loss-masked tokens seen
    distinct_tokens: int  # distinct ids among them
    filled_tokens: int  # ids added without being seen, because fewer than N distinct ids occurred
    coverage: float  # fraction of counted tokens whose id is in the draft vocabulary

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def message(self) -> str:
        text = (f"draft vocabulary: {self.draft_vocab_size} of {self.target_vocab_size} target ids cover "
                f"{self.coverage:.1%} of {self.counted_tokens} response tokens")
        if self.filled_tokens:
            text += (f"; only {self.distinct_tokens} distinct ids occurred, so the {self.filled_tokens} lowest unused "
                     "ids fill the rest")
        return text


def count_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counts [vocab_size] of the ids where loss_mask is set."""
    ids = input_ids.reshape(-1).long()[loss_mask.reshape(-1).bool()]
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ConfigError(
            f"token id {int(ids.max()) if ids.max() >= vocab_size else int(ids.min())} is outside the target "
            f"vocabulary of {vocab_size}; the traces were made with another tokenizer"
        )
    return torch.bincount(ids, minlength=vocab_size)


def build_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, VocabReport]:
    """(d2t int64 [N], t2d bool [V], report): top N ids by count (ties to the lower id), sorted ascending."""
    counts = counts.long().cpu()
    vocab = counts.numel()
    if not 1 <= draft_vocab_size <= vocab:
        raise ConfigError(f"draft_vocab_size={draft_vocab_size} must be between 1 and the target vocab_size={vocab}")
    # Stable sort on descending count keeps ties in ascending id order: deterministic across runs.
    order = torch.sort(-counts, stable=True).indices
    seen = int((counts > 0).sum())
    chosen = order[: min(draft_vocab_size, seen)]
    filled = draft_vocab_size - chosen.numel()
    if filled:
        unused = torch.ones(vocab, dtype=torch.bool)
        unused[chosen] = False
        chosen = torch.cat([chosen, unused.nonzero().squeeze(1)[:filled]])
    used = torch.sort(chosen).values
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    total = int(counts.sum())
    report = VocabReport(
        target_vocab_size=vocab, draft_vocab_size=draft_vocab_size, counted_tokens=total, distinct_tokens=seen,
        filled_tokens=filled, coverage=float(counts[used].sum()) / total if total else 0.0,
    )
    return d2t, t2d, report


def counts_from_hidden_shards(store, parts, vocab_size: int, expected: dict | None = None) -> torch.Tensor:
    """Token counts over the loss-masked tokens of hidden-state shard parts (draftline.drafter.data.ShardPart: only
    their sequences; reads only input_ids, loss_mask and cu_seqlens; with `expected`, each shard's bytes are checked
    against its manifest entry first)."""
    from draftline.drafter.data import read_shard_tensors

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for part in parts:
        tensors = read_shard_tensors(store, part.key, names=("input_ids", "loss_mask", "cu_seqlens"),
                                     expect=(expected or {}).get(part.key))
        cu = tensors["cu_seqlens"].tolist()
        a, b = cu[part.start], cu[len(cu) - 1 if part.stop is None else part.stop]
        counts += count_tokens(tensors["input_ids"][a:b], tensors["loss_mask"][a:b], vocab_size)
    return counts


def counts_from_traces(store, keys: list[str], vocab_size: int) -> torch.Tensor:
    """Token counts over the loss-masked tokens of trace shards (JSON lines with input_ids and loss_mask)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for key in keys:
        for line in store.get_bytes(key).decode().splitlines():
            if line.strip():
                trace = json.loads(line)
                counts += count_tokens(torch.tensor(trace["input_ids"]), torch.tensor(trace["loss_mask"]), vocab_size)
    return counts
