"""Stream hidden-state shards (contract D) from the store as packed training batches in a seeded, resumable order."""
from __future__ import annotations

import json
import re
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from draftline.errors import ConfigError
from draftline.layout import hidden_prefix
from draftline.state_storage import BF16, FP8_E4M3, SCALE_SUFFIX, STATE_NAMES, dequantize_rows

_SHARD = re.compile(r"(^|/)shard-\d{5}\.safetensors$")


def hidden_shard_keys(store, run: str) -> list[str]:
    """Sorted keys of `<run>/hidden/shard-NNNNN.safetensors`; an empty stage is an error naming the fix."""
    keys = [k for k in store.list(hidden_prefix(run) + "/") if _SHARD.search(k)]
    if not keys:
        raise ConfigError(
            f"{store.uri(hidden_prefix(run))}/ holds no hidden-state shards; run the extraction stage for run {run!r} first"
        )
    return keys


def _local_path(store, key: str) -> Path | None:
    path = getattr(store, "path", None)
    return Path(path(key)) if callable(path) else None


def hidden_shard_entries(store, run: str, keys: list[str]) -> dict:
    """The extraction stage's manifest entry (size, sha256) of each shard key it lists; {} without a manifest."""
    manifest = store.read_manifest(hidden_prefix(run))
    return {} if manifest is None else {k: manifest[k] for k in keys if k in manifest}


# Local shards already checked against their manifest entry in this process: (uri, sha256).
_VERIFIED: set[tuple[str, str]] = set()


def read_shard_tensors(store, key: str, names=None, expect=None) -> dict[str, torch.Tensor]:
    """Tensors of one shard (only `names` if given), hidden states in bf16 whatever the shard's storage (fp8 states
    are dequantized with their scales); remote shards pass through a temporary local file. With `expect` (its
    manifest entry) the bytes are checked first, once per process for a local shard (one extra read) and while
    downloading for a remote one: a shard damaged after extraction raises IntegrityError naming it."""
    local = _local_path(store, key)
    if local is not None:
        if expect is not None and (store.uri(key), expect.sha256) not in _VERIFIED:
            store.verify(key, expect)
            _VERIFIED.add((store.uri(key), expect.sha256))
        return _load(local, names)
    with tempfile.TemporaryDirectory(prefix="draftline-shard-") as tmp:
        path = Path(tmp) / "shard.safetensors"
        store.get_file(key, path, expect=expect)
        return _load(path, names)


def _load(path: Path, names) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        # Shards written before extract.storage existed carry no "storage" entry: they are bf16.
        storage = (f.metadata() or {}).get("storage", BF16)
        if storage not in (BF16, FP8_E4M3):
            raise ConfigError(f"hidden-state shard {path.name} stores its states as {storage!r}, which this draftline "
                              "cannot read; upgrade draftline or re-extract with extract.storage: bf16")
        scales = [n + SCALE_SUFFIX for n in STATE_NAMES] if storage == FP8_E4M3 else []
        wanted = [k for k in f.keys() if k not in scales] if names is None else list(names)
        missing = [n for n in wanted + [n + SCALE_SUFFIX for n in STATE_NAMES if n in wanted and scales]
                   if n not in f.keys()]
        if missing:
            raise ConfigError(f"hidden-state shard {path.name} lacks {missing}; re-run the extraction stage")
        out = {n: f.get_tensor(n) for n in wanted}
        for n in STATE_NAMES:
            if scales and n in out:
                out[n] = dequantize_rows(out[n], f.get_tensor(n + SCALE_SUFFIX))
        return out


def read_shard_metadata(store, key: str) -> dict[str, str]:
    """The safetensors metadata of a shard, read from its header only."""
    with store.open(key) as stream:
        (size,) = struct.unpack("<Q", stream.read(8))
        header = json.loads(stream.read(size))
    return header.get("__metadata__", {})


@dataclass(frozen=True)
class ShardPart:
    """Sequences [start, stop) of one hidden-state shard, in the shard's order (stop None: to its end)."""

    key: str
    start: int = 0
    stop: int | None = None
    tokens: int | None = field(default=None, compare=False)  # the stored tokens of these sequences, where known

    def __str__(self) -> str:
        return f"{self.key}[{self.start}:{'' if self.stop is None else self.stop}]"


def shard_cu_seqlens(store, key: str, expect=None) -> list[int]:
    """The sequence boundaries of a shard (its cu_seqlens tensor only, for a local shard)."""
    return read_shard_tensors(store, key, names=("cu_seqlens",), expect=expect)["cu_seqlens"].tolist()


def split_validation(store, keys: list[str], entries: dict, val_fraction: float
                     ) -> tuple[list[ShardPart], list[ShardPart]]:
    """(train, validation) parts: validation holds out the last sequences (shard order, then sequence order) until
    their tokens reach val_fraction of all tokens, at least one when there are two or more, never all of them.

    Whole shards are counted from their manifest entries (`tokens`, `sequences`); the shard at the boundary, and any
    whose entry lacks the counts, from its cu_seqlens."""
    counts = {}
    for key in keys:
        meta = getattr(entries.get(key), "metadata", None) or {}
        if "tokens" in meta and "sequences" in meta:
            counts[key] = (int(meta["tokens"]), int(meta["sequences"]))
        else:
            cu = shard_cu_seqlens(store, key, entries.get(key))
            counts[key] = (cu[-1] - cu[0], len(cu) - 1)
    total_tokens = sum(t for t, _ in counts.values())
    total_sequences = sum(n for _, n in counts.values())
    whole = lambda key: ShardPart(key, 0, counts[key][1], counts[key][0])  # noqa: E731
    if val_fraction <= 0 or total_sequences < 2:
        return [whole(k) for k in keys if counts[k][1]], []
    target = val_fraction * total_tokens
    held_tokens, held_sequences = 0, 0
    val: list[ShardPart] = []
    for i in range(len(keys) - 1, -1, -1):
        key = keys[i]
        tokens, sequences = counts[key]
        # At least one sequence stays in training: the walk stops before the first shard's first sequence.
        room = total_sequences - 1 - held_sequences
        if held_tokens + tokens <= target and sequences <= room:
            held_tokens, held_sequences = held_tokens + tokens, held_sequences + sequences
            if sequences:
                val.insert(0, whole(key))
            continue
        cu = shard_cu_seqlens(store, key, entries.get(key))
        start = sequences
        while start > 0 and held_tokens < target and sequences - start < room:
            start -= 1
            held_tokens += cu[start + 1] - cu[start]
        held_sequences += sequences - start
        train = [whole(k) for k in keys[:i] if counts[k][1]]
        if start > 0:
            train.append(ShardPart(key, 0, start, cu[start] - cu[0]))
        if start < sequences:
            val.insert(0, ShardPart(key, start, sequences, cu[-1] - cu[start]))
        return train, val
    return [], val  # not reached: the walk stops at the boundary shard before it takes every sequence


def held_out_summary(train: list[ShardPart], val: list[ShardPart]) -> dict:
    """The validation's sequences and tokens, and its share of all tokens (None where a part's tokens are unknown)."""
    parts = train + val
    known = all(p.tokens is not None for p in parts)
    total = sum(p.tokens for p in parts) if known else 0
    return {"val_sequences": sum(p.stop - p.start for p in val if p.stop is not None),
            "val_tokens": sum(p.tokens for p in val) if known else None,
            "held_out_share": sum(p.tokens for p in val) / total if known and total else None}


@dataclass
class Sequence:
    input_ids: torch.Tensor  # [n] int64
    loss_mask: torch.Tensor  # [n] bool
    aux: torch.Tensor  # [n, 3*Ht]
    last: torch.Tensor  # [n, Ht]

    def __len__(self) -> int:
        return self.input_ids.numel()


def shard_sequences(tensors: dict[str, torch.Tensor], max_seq_len: int, start: int = 0, stop: int | None = None
                    ) -> list[Sequence]:
    """Split a shard at cu_seqlens into its sequences [start, stop), each cut to max_seq_len tokens."""
    cu = tensors["cu_seqlens"].tolist()[start:None if stop is None else stop + 1]
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        b = min(b, a + max_seq_len)
        if b - a >= 2:  # a one-token sequence has no next token to predict
            out.append(Sequence(tensors["input_ids"][a:b].long(), tensors["loss_mask"][a:b].bool(),
                                tensors["aux_hidden_states"][a:b], tensors["last_hidden_states"][a:b]))
    return out


def part_sequences(store, part: ShardPart, max_seq_len: int, expected: dict | None = None) -> list[Sequence]:
    """The sequences of one shard part, each cut to max_seq_len tokens."""
    tensors = read_shard_tensors(store, part.key, expect=(expected or {}).get(part.key))
    return shard_sequences(tensors, max_seq_len, part.start, part.stop)


@dataclass
class Cursor:
    """Where the stream stands: epoch, position in that epoch's part order, next sequence in that part."""

    epoch: int = 0
    shard: int = 0
    seq: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _permutation(n: int, *seed_parts: int) -> list[int]:
    g = torch.Generator().manual_seed(hash(tuple(seed_parts)) & 0x7FFF_FFFF_FFFF)
    return torch.randperm(n, generator=g).tolist()


class BatchStream:
    """Endless global batches of whole sequences (about tokens_per_batch tokens) in an order fixed by the seed.

    Reads shard parts (a part's sequences only, sliced before shuffling so that a cursor always means the same data);
    one part is in memory at a time (the next is fetched in the background); the cursor after each batch is enough
    to resume the exact same sequence of batches.
    """

    def __init__(self, store, parts: list[ShardPart], tokens_per_batch: int, max_seq_len: int, seed: int,
                 cursor: Cursor | None = None, shuffle: bool = True, epochs: int | None = None,
                 expected: dict | None = None):
        if not parts:
            raise ConfigError("no hidden-state sequences to train on; lower train.val_fraction or extract more traces")
        self.store, self.parts = store, list(parts)
        self.expected = expected or {}  # key -> manifest entry each shard is checked against
        self.tokens_per_batch, self.max_seq_len = tokens_per_batch, max_seq_len
        self.seed, self.shuffle, self.epochs = seed, shuffle, epochs
        self.cursor = cursor or Cursor()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftline-shard-fetch")
        self._pending: dict[tuple[int, int], object] = {}
        self._loaded: tuple[tuple[int, int], list[Sequence]] | None = None

    def _part_order(self, epoch: int) -> list[int]:
        return _permutation(len(self.parts), self.seed, epoch) if self.shuffle else list(range(len(self.parts)))

    def _fetch(self, epoch: int, pos: int) -> list[Sequence]:
        part = self.parts[self._part_order(epoch)[pos]]
        seqs = part_sequences(self.store, part, self.max_seq_len, self.expected)
        if self.shuffle:
            seqs = [seqs[i] for i in _permutation(len(seqs), self.seed, epoch, pos, 1)]
        return seqs

    def _next_slot(self, epoch: int, pos: int) -> tuple[int, int]:
        return (epoch, pos + 1) if pos + 1 < len(self.parts) else (epoch + 1, 0)

    def _sequences(self, epoch: int, pos: int) -> list[Sequence]:
        slot = (epoch, pos)
        if self._loaded is None or self._loaded[0] != slot:
            future = self._pending.pop(slot, None)
            seqs = future.result() if future is not None else self._fetch(epoch, pos)
            self._loaded = (slot, seqs)
            nxt = self._next_slot(epoch, pos)
            if nxt not in self._pending and (self.epochs is None or nxt[0] < self.epochs):
                self._pending = {nxt: self._pool.submit(self._fetch, *nxt)}
        return self._loaded[1]

    def next_batch(self) -> list[Sequence] | None:
        """The next global batch (None when a finite stream is exhausted); advances the cursor."""
        batch, tokens = [], 0
        c = Cursor(**self.cursor.to_dict())
        while tokens < self.tokens_per_batch:
            if self.epochs is not None and c.epoch >= self.epochs:
                break
            seqs = self._sequences(c.epoch, c.shard)
            if c.seq >= len(seqs):
                c.epoch, c.shard = self._next_slot(c.epoch, c.shard)
                c.seq = 0
                continue
            seq = seqs[c.seq]
            if batch and tokens + len(seq) > self.tokens_per_batch:
                break
            batch.append(seq)
            tokens += len(seq)
            c.seq += 1
        self.cursor = c
        return batch or None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def pack_rows(seqs: list[Sequence], max_seq_len: int) -> list[list[Sequence]]:
    """Greedy in-order packing of sequences into rows of at most max_seq_len tokens."""
    rows, row, used = [], [], 0
    for s in seqs:
        if row and used + len(s) > max_seq_len:
            rows.append(row)
            row, used = [], 0
        row.append(s)
        used += len(s)
    if row:
        rows.append(row)
    return rows


def collate(rows: list[list[Sequence]], aux_width: int, hidden_size: int, length: int | None = None
            ) -> dict[str, torch.Tensor]:
    """Rows of packed sequences -> padded tensors; doc ids (-1 = padding) keep attention inside each sequence.

    length: pad every row to this many tokens (at least the longest row), so that batches keep one shape; compiled
    flex attention recompiles for every new shape and gives up after a few."""
    r = max(1, len(rows))
    t = max([sum(len(s) for s in row) for row in rows] + [2, length or 0])
    dtype = rows[0][0].aux.dtype if rows and rows[0] else torch.bfloat16
    out = {
        "input_ids": torch.zeros(r, t, dtype=torch.long),
        "loss_mask": torch.zeros(r, t, dtype=torch.bool),
        "doc_ids": torch.full((r, t), -1, dtype=torch.long),
        "position_ids": torch.zeros(r, t, dtype=torch.long),
        "aux": torch.zeros(r, t, aux_width, dtype=dtype),
        "last": torch.zeros(r, t, hidden_size, dtype=dtype),
    }
    for i, row in enumerate(rows):
        at = 0
        for d, s in enumerate(row):
            n = len(s)
            sl = slice(at, at + n)
            out["input_ids"][i, sl] = s.input_ids
            out["loss_mask"][i, sl] = s.loss_mask
            out["doc_ids"][i, sl] = d
            out["position_ids"][i, sl] = torch.arange(n)
            out["aux"][i, sl] = s.aux
            out["last"][i, sl] = s.last
            at += n
    return out


def rank_rows(rows: list[list[Sequence]], rank: int, world_size: int) -> list[list[Sequence]]:
    """This rank's share of a global batch's rows (round-robin); a rank left without rows gets an empty one."""
    return rows[rank::world_size] or [[]]

