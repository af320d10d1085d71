"""What a training run reads, whichever the source: the extraction's shards here, an engine beside the trainer in
draftline.online; both give the same batches, validation parts and record."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import torch

from draftline.aux_ids import VLLM, AuxLayerIds
from draftline.drafter.data import (BatchStream, Cursor, ShardPart, held_out_summary, hidden_shard_entries,
                                    hidden_shard_keys, read_shard_metadata, split_validation)
from draftline.drafter.vocab import counts_from_hidden_shards


@dataclass
class TrainingData:
    """What a training run reads, from the extraction's shards or from an engine beside it (draftline.online): the
    aux layers, the validation's shard parts, the training batches from a cursor, and what a checkpoint and the
    training record say about them."""

    aux_ids: list[int]
    val_parts: list[ShardPart]
    expected: dict  # key -> manifest entry each shard is checked against
    identity: dict  # what a resumed checkpoint must agree with
    record: dict  # train_shards, val_shards and the held-out summary, for the training record
    token_counts: Callable[[int], torch.Tensor]  # vocab_size -> counts of the training's loss-masked tokens
    # (cursor, rank, world, barrier, steps still to train) -> a stream with next_batch(), cursor and close()
    open_stream: Callable[..., Any]


def shard_training_data(store, run: str, val_fraction: float, tokens_per_batch: int, max_seq_len: int, seed: int
                        ) -> TrainingData:
    """Training on the run's hidden-state shards (`<run>/hidden/`), validation holding out their last sequences."""
    keys = hidden_shard_keys(store, run)
    entries = hidden_shard_entries(store, run, keys)  # every shard is checked against these before it is used
    train_parts, val_parts = split_validation(store, keys, entries, val_fraction)
    meta = read_shard_metadata(store, keys[0])
    aux_ids = AuxLayerIds.stored(json.loads(meta["aux_layer_ids"]), meta.get("convention", VLLM), store.uri(keys[0]),
                                 "extract the hidden states again").as_list()
    # The shards' contents, not only their names: re-extracted shards (another storage, another target) start over.
    # And the split: a cursor counts positions in the training parts, which mean other data under another split.
    identity = {"shards": [[k, entries[k].sha256 if k in entries else None] for k in keys],
                "train": [str(p) for p in train_parts], "val": [str(p) for p in val_parts]}
    record = {"train_shards": [str(p) for p in train_parts], "val_shards": [str(p) for p in val_parts],
              **held_out_summary(train_parts, val_parts)}

    def open_stream(cursor: Cursor, rank: int = 0, world: int = 1, barrier=None, steps: int | None = None
                    ) -> BatchStream:
        return BatchStream(store, train_parts, tokens_per_batch, max_seq_len, seed, cursor=cursor, expected=entries)

    return TrainingData(aux_ids, val_parts, entries, identity, record,
                        lambda vocab_size: counts_from_hidden_shards(store, train_parts, vocab_size, entries),
                        open_stream)
