"""Validation holds out the last sequences, not whole shards: its share of the tokens is train.val_fraction whatever
the shard size, and training never reads a held-out sequence."""
import itertools
import json

import pytest
import torch
from safetensors.torch import save

from draftline.drafter.data import (BatchStream, Cursor, ShardPart, held_out_summary, hidden_shard_entries,
                                    hidden_shard_keys, split_validation)
from draftline.drafter.vocab import counts_from_hidden_shards
from draftline.store import open_store

H = 4  # hidden size of the fake shards


def write_shards(root, shard_lengths: list[list[int]], run: str = "r", manifest: bool = True):
    """Hidden-state shards (contract D) whose every token of global sequence i has input id i, so a test can tell
    which sequences it was given; with a manifest carrying tokens and sequences, as extraction writes it."""
    store = open_store(str(root))
    entries, seq = [], 0
    for s, lengths in enumerate(shard_lengths):
        ids = torch.cat([torch.full((n,), seq + i, dtype=torch.int64) for i, n in enumerate(lengths)])
        n = ids.numel()
        tensors = {"input_ids": ids, "loss_mask": torch.ones(n, dtype=torch.uint8),
                   "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64),
                   "aux_hidden_states": torch.zeros(n, 3 * H, dtype=torch.bfloat16),
                   "last_hidden_states": torch.zeros(n, H, dtype=torch.bfloat16)}
        meta = {"aux_layer_ids": "[2, 4, 5]", "convention": "vllm", "hidden_size": str(H), "storage": "bf16",
                "trace_ids": json.dumps([f"t{seq + i}" for i in range(len(lengths))])}
        entries.append(store.put_bytes(f"{run}/hidden/shard-{s:05d}.safetensors", save(tensors, meta),
                                       {"tokens": n, "sequences": len(lengths)}))
        seq += len(lengths)
    if manifest:
        store.write_manifest(f"{run}/hidden", entries)
    keys = hidden_shard_keys(store, run)
    return store, keys, hidden_shard_entries(store, run, keys)


def lengths(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(20, 120, (n,), generator=g).tolist()


def sequence_ids(parts: list[ShardPart], shard_lengths: list[list[int]], keys: list[str]) -> list[int]:
    """The global sequence numbers the parts cover, in order."""
    first = dict(zip(keys, itertools.accumulate([0] + [len(x) for x in shard_lengths])))
    return [first[p.key] + i for p in parts for i in range(p.start, p.stop)]


def test_two_big_shards_hold_out_val_fraction_of_the_tokens_within_one_sequence(tmp_path):
    shard_lengths = [lengths(300, 0), lengths(300, 1)]
    store, keys, entries = write_shards(tmp_path, shard_lengths)
    total = sum(map(sum, shard_lengths))
    for fraction in (0.05, 0.2):
        train, val = split_validation(store, keys, entries, fraction)
        held = sum(sum(shard_lengths[keys.index(p.key)][p.start:p.stop]) for p in val)
        longest = max(itertools.chain(*shard_lengths))
        assert fraction * total <= held < fraction * total + longest, (fraction, held / total)
        summary = held_out_summary(train, val)
        assert summary["held_out_share"] == pytest.approx(held / total)
        assert summary["val_tokens"] == held and summary["val_sequences"] == len(sequence_ids(val, shard_lengths, keys))
        # The last shard is split: its leading sequences train, its trailing ones validate.
        assert [str(p) for p in val] == [f"{keys[1]}[{val[0].start}:300]"] and 0 < val[0].start < 300
        assert [str(p) for p in train] == [f"{keys[0]}[0:300]", f"{keys[1]}[0:{val[0].start}]"]


def test_train_and_validation_cover_every_sequence_exactly_once(tmp_path):
    shard_lengths = [lengths(40, 2), lengths(7, 3), lengths(25, 4), lengths(3, 5)]
    store, keys, entries = write_shards(tmp_path, shard_lengths)
    everything = list(range(sum(map(len, shard_lengths))))
    for fraction in (0.01, 0.05, 0.1, 0.3, 0.5, 0.9):
        train, val = split_validation(store, keys, entries, fraction)
        t, v = sequence_ids(train, shard_lengths, keys), sequence_ids(val, shard_lengths, keys)
        assert t + v == everything, fraction  # train first, validation last, each sequence once
        assert t and v and not set(t) & set(v)


def test_a_shard_without_counts_in_the_manifest_splits_the_same_from_its_cu_seqlens(tmp_path):
    shard_lengths = [lengths(30, 6), lengths(30, 7), lengths(30, 8)]
    store, keys, entries = write_shards(tmp_path / "a", shard_lengths)
    bare, bare_keys, none = write_shards(tmp_path / "b", shard_lengths, manifest=False)
    assert none == {}
    for fraction in (0.05, 0.4):
        a = split_validation(store, keys, entries, fraction)
        b = split_validation(bare, bare_keys, none, fraction)
        assert [[str(p) for p in side] for side in a] == [[str(p) for p in side] for side in b]
        assert held_out_summary(*a) == held_out_summary(*b)


def test_one_shard_is_split_into_training_and_validation(tmp_path):
    shard_lengths = [lengths(50, 9)]
    store, keys, entries = write_shards(tmp_path, shard_lengths)
    train, val = split_validation(store, keys, entries, 0.1)
    assert len(train) == len(val) == 1 and train[0].key == val[0].key == keys[0]
    assert train[0].start == 0 and train[0].stop == val[0].start and val[0].stop == 50 and val[0].start < 50
    assert 0.1 <= held_out_summary(train, val)["held_out_share"] < 0.1 + max(shard_lengths[0]) / sum(shard_lengths[0])


def test_at_least_one_sequence_on_each_side_of_a_split(tmp_path):
    store, keys, entries = write_shards(tmp_path, [[50], [50]])
    assert sequence_ids(split_validation(store, keys, entries, 0.001)[1], [[50], [50]], keys) == [1]
    assert sequence_ids(split_validation(store, keys, entries, 0.99)[0], [[50], [50]], keys) == [0]
    single, keys, entries = write_shards(tmp_path / "one", [[50]])
    train, val = split_validation(single, keys, entries, 0.5)  # one sequence: nothing to validate on
    assert [str(p) for p in train] == [f"{keys[0]}[0:1]"] and val == []


def test_val_fraction_zero_gives_no_validation(tmp_path):
    shard_lengths = [lengths(20, 10), lengths(20, 11)]
    store, keys, entries = write_shards(tmp_path, shard_lengths)
    train, val = split_validation(store, keys, entries, 0.0)
    assert val == [] and [str(p) for p in train] == [f"{keys[0]}[0:20]", f"{keys[1]}[0:20]"]
    assert held_out_summary(train, val) == {"val_sequences": 0, "val_tokens": 0, "held_out_share": 0.0}


def _drain(stream: BatchStream, batches: int) -> list[tuple[list[int], Cursor]]:
    out = []
    for _ in range(batches):
        if (batch := stream.next_batch()) is None:
            break
        out.append(([int(s.input_ids[0]) for s in batch], Cursor(**stream.cursor.to_dict())))
    return out


def test_training_batches_never_hold_a_validation_sequence_and_resume_exactly(tmp_path):
    shard_lengths = [lengths(30, 12), lengths(30, 13), lengths(30, 14)]
    store, keys, entries = write_shards(tmp_path, shard_lengths)
    train, val = split_validation(store, keys, entries, 0.25)
    assert train[-1].key == val[0].key  # the boundary shard is in both
    train_ids, val_ids = sequence_ids(train, shard_lengths, keys), set(sequence_ids(val, shard_lengths, keys))
    stream = BatchStream(store, train, 400, 256, seed=3, expected=entries)
    batches = _drain(stream, 60)  # several epochs: about 7,800 training tokens in batches of about 400
    stream.close()
    seen = [i for ids, _ in batches for i in ids]
    assert not set(seen) & val_ids
    epochs = batches[-1][1].epoch
    assert epochs >= 3 and sorted(seen[:len(train_ids)]) == train_ids  # each epoch reads every training sequence
    for at in (5, 23, 41):  # a stream started from a cursor continues with the same batches
        resumed = BatchStream(store, train, 400, 256, seed=3, cursor=batches[at][1], expected=entries)
        again = _drain(resumed, 10)
        resumed.close()
        assert again == batches[at + 1:at + 11]

    vstream = BatchStream(store, val, 400, 256, seed=3, shuffle=False, epochs=1, expected=entries)
    read = [i for ids, _ in _drain(vstream, 30) for i in ids]
    vstream.close()
    assert read == sorted(val_ids)  # validation reads its sequences once, in order


def test_the_draft_vocabulary_counts_only_the_training_sequences(tmp_path):
    shard_lengths = [lengths(10, 15), lengths(10, 16)]
    store, keys, entries = write_shards(tmp_path, shard_lengths)
    train, val = split_validation(store, keys, entries, 0.3)
    counts = counts_from_hidden_shards(store, train, 64, entries)
    flat = list(itertools.chain(*shard_lengths))
    train_ids = set(sequence_ids(train, shard_lengths, keys))
    assert counts[:20].tolist() == [n if i in train_ids else 0 for i, n in enumerate(flat)]
