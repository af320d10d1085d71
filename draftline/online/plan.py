"""The order online training reads traces in, derived alike by the engine side and the trainer from the same config:
the held-out validation traces, the training traces, each epoch's seeded order, and the ordinals that name them."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from draftline.errors import ConfigError
from draftline.hidden_shards import ShardPlan, trace_entries
from draftline.shards import spec_hash


def split_traces(lengths: list[int], val_fraction: float) -> tuple[list[int], list[int]]:
    """(train, validation) trace indices: validation holds out the last traces until their tokens reach val_fraction
    of all tokens, at least one when there are two or more, never all of them (the shard path's rule, on traces)."""
    n = len(lengths)
    if val_fraction <= 0 or n < 2:
        return list(range(n)), []
    target, held, start = val_fraction * sum(lengths), 0, n
    while start > 1 and held < target:
        start -= 1
        held += lengths[start]
    return list(range(start)), list(range(start, n))


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """Positions 0..count-1 in the seeded order of one epoch."""
    g = torch.Generator().manual_seed(hash((seed, epoch, 0x6F6E)) & 0x7FFF_FFFF_FFFF)
    return torch.randperm(count, generator=g).tolist()


@dataclass
class OnlinePlan:
    """Every trace of a run (tokens, loss mask, where it is stored), split into training and validation.

    An ordinal names one training sequence of the endless stream: epoch * len(train) + position in that epoch's
    order. The engine captures ordinals in order; the trainer reads them in order; both compute the same names.
    """

    keys: list[str]  # per trace: the trace shard it is stored in
    lines: list[int]  # per trace: its line there
    ids: list[str]  # per trace: its id
    offsets: torch.Tensor  # [traces + 1] int64: trace t's tokens are input_ids[offsets[t]:offsets[t + 1]]
    input_ids: torch.Tensor  # every trace's tokens, one after another (int64)
    loss_mask: torch.Tensor  # [tokens] bool
    train: list[int]  # trace indices trained on, in trace order
    val: list[int]  # trace indices held out, in trace order
    max_seq_len: int
    seed: int
    fingerprint: str
    _orders: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def length(self, trace: int) -> int:
        return int(self.offsets[trace + 1] - self.offsets[trace])

    def tokens(self, trace: int) -> int:
        """The tokens the engine captures and training reads of a training trace: at most max_seq_len."""
        return min(self.length(trace), self.max_seq_len)

    def trace_tokens(self, trace: int, cut: bool = True) -> list[int]:
        a = int(self.offsets[trace])
        return self.input_ids[a:a + (self.tokens(trace) if cut else self.length(trace))].tolist()

    def trace_mask(self, trace: int) -> torch.Tensor:
        a = int(self.offsets[trace])
        return self.loss_mask[a:a + self.tokens(trace)]

    def order(self, epoch: int) -> list[int]:
        """The training traces of one epoch, in the order they are read."""
        if epoch not in self._orders:
            if len(self._orders) > 2:  # the engine and the trainer are at most an epoch apart
                self._orders.pop(min(self._orders))
            self._orders[epoch] = [self.train[i] for i in epoch_order(len(self.train), self.seed, epoch)]
        return self._orders[epoch]

    def ordinal(self, epoch: int, position: int) -> int:
        return epoch * len(self.train) + position

    def position(self, ordinal: int) -> tuple[int, int]:
        return divmod(ordinal, len(self.train))

    def trace_of(self, ordinal: int) -> int:
        epoch, pos = self.position(ordinal)
        return self.order(epoch)[pos]

    @property
    def train_tokens(self) -> int:
        return sum(self.tokens(t) for t in self.train)

    def val_shards(self, tokens_per_shard: int) -> list[ShardPlan]:
        """The validation traces grouped, in order, into shards of about tokens_per_shard tokens."""
        shards: list[ShardPlan] = []
        ranges: list[list] = []
        tokens = seqs = 0
        for t in self.val:
            n = self.length(t)
            if seqs and tokens + n > tokens_per_shard:
                shards.append(ShardPlan(len(shards), [tuple(r) for r in ranges], tokens, seqs))
                ranges, tokens, seqs = [], 0, 0
            if ranges and ranges[-1][0] == self.keys[t] and ranges[-1][2] == self.lines[t]:
                ranges[-1][2] += 1
            else:
                ranges.append([self.keys[t], self.lines[t], self.lines[t] + 1])
            tokens, seqs = tokens + n, seqs + 1
        if seqs:
            shards.append(ShardPlan(len(shards), [tuple(r) for r in ranges], tokens, seqs))
        return shards

    def val_traces(self, shard: ShardPlan) -> list[dict]:
        """The traces of one validation shard as the shard writer takes them."""
        out = []
        for key, a, b in shard.ranges:
            for t in (i for i in self.val if self.keys[i] == key and a <= self.lines[i] < b):
                lo, hi = int(self.offsets[t]), int(self.offsets[t + 1])
                out.append({"id": self.ids[t], "input_ids": self.input_ids[lo:hi].tolist(),
                            "loss_mask": self.loss_mask[lo:hi].int().tolist()})
        return out


def build_plan(store, run: str, val_fraction: float, max_seq_len: int, seed: int, identity: dict) -> OnlinePlan:
    """The plan of run's traces (read from the store, checked against their manifest). `identity` names what else
    decides the states (target, layers, storage): the fingerprint covers it, so both sides refuse to mix runs."""
    entries = trace_entries(store, run)
    keys, lines, ids, lengths, tokens, masks = [], [], [], [], [], []
    for e in entries:
        for line, raw in enumerate(x for x in store.get_bytes(e.key, expect=e).decode("utf-8").splitlines()
                                   if x.strip()):
            trace = json.loads(raw)
            if len(trace["input_ids"]) != len(trace["loss_mask"]):
                raise ConfigError(f"trace {trace.get('id')!r} has {len(trace['input_ids'])} input_ids but "
                                  f"{len(trace['loss_mask'])} loss_mask values; regenerate the traces")
            keys.append(e.key)
            lines.append(line)
            ids.append(str(trace.get("id", f"{e.key}:{line}")))
            lengths.append(len(trace["input_ids"]))
            tokens.append(torch.tensor(trace["input_ids"], dtype=torch.int64))
            masks.append(torch.tensor(trace["loss_mask"], dtype=torch.bool))
    if not keys:
        raise ConfigError(f"run {run!r} has no traces to train on; check the trace stage's stats.json")
    train, val = split_traces(lengths, val_fraction)
    train = [t for t in train if min(lengths[t], max_seq_len) >= 2]  # one token has no next token to predict
    if not train:
        raise ConfigError("no trace of two or more tokens is left to train on; lower train.val_fraction or generate "
                          "more traces")
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    fingerprint = spec_hash({"traces": [(e.key, e.sha256) for e in entries], "val_fraction": val_fraction,
                             "max_seq_len": max_seq_len, "seed": seed, **identity})[:16]
    return OnlinePlan(keys, lines, ids, offsets, torch.cat(tokens), torch.cat(masks), train, val, max_seq_len, seed,
                      fingerprint)


class EpochCache:
    """Which training sequences the trainer serves from its memory after their first read: walking the ordinals from
    where a trainer starts, each trace is kept at its first visit while `room` tokens remain. The trainer keeps them by
    this rule and the engine side walks the same, so the engine skips their later visits without being told."""

    def __init__(self, plan: OnlinePlan, room: int):
        self.plan, self.room = plan, room
        self.first: dict[int, int] = {}  # trace -> the ordinal it was kept at

    def needs_engine(self, ordinal: int) -> bool:
        """Whether the sequence at `ordinal` comes from the engine (visit every ordinal once, in increasing order; a
        second visit of one already walked gives the same answer)."""
        trace = self.plan.trace_of(ordinal)
        if trace in self.first:
            return self.first[trace] == ordinal
        tokens = self.plan.tokens(trace)
        if self.room >= tokens:
            self.first[trace] = ordinal
            self.room -= tokens
        return True
