"""The shard writer: parallel writers give the same bytes as one, a failed write names its shard, host memory stays bounded."""
from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftline.config import ExtractConfig
from draftline.errors import ConfigError, ShardWriteError
from draftline.extract import HiddenStateExtractor, extract_hidden_states, run_overlapped
from draftline.hidden_shards import ShardPlan, num_hidden_shards
from draftline.safetensors_io import safetensors_chunks
from draftline.store import ChunkReader, open_store
from tests.test_extract import _copy_traces, write_traces

CFG = ExtractConfig(batch_tokens=64, tokens_per_shard=100, device="cpu")


@pytest.fixture(scope="module")
def traces_store(tmp_path_factory, target_dirs):
    from transformers import AutoTokenizer

    store = open_store(str(tmp_path_factory.mktemp("writer-traces")))
    tok = AutoTokenizer.from_pretrained(target_dirs["llama"])
    write_traces(store, "r", tok, tok.vocab_size)
    return store


def _fresh(traces_store, root: Path):
    store = open_store(str(root))
    _copy_traces(traces_store, "r", store, "r")
    return store


def _golden_tensors():
    h = 4
    aux = (torch.arange(5 * 3 * h, dtype=torch.float32) / 7).to(torch.bfloat16).reshape(5, 3 * h)
    last = (-torch.arange(5 * h, dtype=torch.float32) / 3).to(torch.bfloat16).reshape(5, h)
    tensors = {"input_ids": torch.tensor([11, 12, 13, 21, 22]), "loss_mask": torch.tensor([0, 1, 1, 0, 1], dtype=torch.uint8),
               "cu_seqlens": torch.tensor([0, 3, 5]), "aux_hidden_states": aux, "last_hidden_states": last}
    meta = {"trace_ids": '["b", "a"]', "aux_layer_ids": "[1, 2, 3]", "convention": "vllm", "hidden_size": "4",
            "target_fingerprint": "x"}
    return tensors, meta


# sha256 of the file the previous single-writer SafetensorsStream wrote for _golden_tensors(): shards must not change.
GOLDEN_SHA256 = "1ab462cbd08bdde88625027ad1a50a1b98fa9698742bb720d895dd952635afa9"


def test_shard_files_keep_their_bytes_whether_written_whole_in_blocks_or_streamed(tmp_path):
    tensors, meta = _golden_tensors()
    store = open_store(str(tmp_path))
    whole = store.put_chunks("whole.safetensors", safetensors_chunks(tensors, meta))
    # Row blocks, as the extractor hands them over per batch, are written one after another.
    blocked = dict(tensors, aux_hidden_states=list(tensors["aux_hidden_states"].split([2, 3])),
                   last_hidden_states=list(tensors["last_hidden_states"].split([4, 1])))
    in_blocks = store.put_chunks("blocks.safetensors", safetensors_chunks(blocked, meta))
    streamed = store.put_stream("streamed.safetensors", ChunkReader(safetensors_chunks(blocked, meta)))  # S3's path
    assert whole.sha256 == in_blocks.sha256 == streamed.sha256 == GOLDEN_SHA256
    data = (tmp_path / "blocks.safetensors").read_bytes()
    assert hashlib.sha256(data).hexdigest() == GOLDEN_SHA256 and len(data) == whole.size
    with safe_open(str(tmp_path / "blocks.safetensors"), "pt") as f:
        assert f.metadata() == meta
        for name, t in tensors.items():
            assert f.get_tensor(name).dtype == t.dtype and torch.equal(f.get_tensor(name), t), name


def test_parallel_writers_publish_the_same_shards_and_manifest_as_one_writer(traces_store, target_dirs, tmp_path):
    stores = {}
    for writers in (1, 4):
        store = stores[writers] = _fresh(traces_store, tmp_path / f"w{writers}")
        cfg = CFG.model_copy(update={"writer_threads": writers})
        result = extract_hidden_states(cfg, target_dirs["llama"], store, "r")
        assert result["computed_shards"] == list(range(result["shards"])) and result["shards"] >= 4
    one, four = (stores[w].read_manifest("r/hidden") for w in (1, 4))
    assert [(e.key, e.size, e.sha256, e.metadata) for e in one] == [(e.key, e.size, e.sha256, e.metadata) for e in four]
    for e in one:
        assert (tmp_path / "w1" / e.key).read_bytes() == (tmp_path / "w4" / e.key).read_bytes(), e.key
        assert hashlib.sha256((tmp_path / "w4" / e.key).read_bytes()).hexdigest() == e.sha256


def test_a_failed_write_raises_an_error_naming_the_shard_and_a_rerun_completes(traces_store, target_dirs, tmp_path,
                                                                             monkeypatch):
    store = _fresh(traces_store, tmp_path)
    total = num_hidden_shards(CFG, store, "r")
    real_put_chunks = type(store).put_chunks

    def disk_full_on_shard_2(self, key, chunks, metadata=None):
        if key.endswith("shard-00002.safetensors"):
            raise OSError(28, "No space left on device")
        return real_put_chunks(self, key, chunks, metadata)

    monkeypatch.setattr(type(store), "put_chunks", disk_full_on_shard_2)
    with pytest.raises(ShardWriteError) as err:
        extract_hidden_states(CFG.model_copy(update={"writer_threads": 3}), target_dirs["llama"], store, "r")
    assert "shard 2 " in str(err.value) and "No space left on device" in str(err.value)
    assert isinstance(err.value.__cause__, OSError)
    assert not store.exists("r/hidden/_done/shard-00002.json") and not store.exists("r/hidden/shard-00002.safetensors")
    assert not store.exists("r/hidden/manifest.json")  # the stage is not reported finished

    monkeypatch.setattr(type(store), "put_chunks", real_put_chunks)
    result = extract_hidden_states(CFG, target_dirs["llama"], store, "r")
    assert 2 in result["computed_shards"] and len(store.read_manifest("r/hidden")) == total


def test_a_slow_disk_holds_back_the_extractor_so_host_memory_stays_bounded(traces_store, target_dirs):
    extractor = HiddenStateExtractor(target_dirs["llama"], None, device="cpu")
    pool = extractor.host_pool
    peak_batches, shards_held, peak_shards = [0], [0], [0]
    lock = threading.Lock()
    real_acquire = pool.acquire

    def counting_acquire(*args, **kwargs):
        buf = real_acquire(*args, **kwargs)
        with lock:
            peak_batches[0] = max(peak_batches[0], pool._handed_out)
        return buf

    pool.acquire = counting_acquire
    real_extract = extractor.extract

    def counting_extract(*args, **kwargs):
        host = real_extract(*args, **kwargs)
        with lock:
            shards_held[0] += 1
            peak_shards[0] = max(peak_shards[0], shards_held[0])
        return host

    extractor.extract = counting_extract

    def slow_write(plan, traces, host):
        time.sleep(0.2)
        with lock:
            shards_held[0] -= 1

    seqs = [[5 + (7 * i + j) % 300 for j in range(20 + i % 5)] for i in range(12)]
    jobs = [(ShardPlan(k, [], 0, 3), [{"input_ids": s} for s in seqs[3 * k:3 * k + 3]]) for k in range(4)]
    # Each shard needs 2 batches of 64 tokens: 3 buffers means a shard waits for a write to finish.
    assert run_overlapped(extractor, jobs, slow_write, 64, writer_threads=2, max_batches_in_flight=3) == [0, 1, 2, 3]
    assert peak_batches[0] <= 3 and pool._handed_out == 0
    # Without a batch limit, shards queue for at most the writers plus the one just computed.
    peak_shards[0] = 0
    assert run_overlapped(extractor, jobs, slow_write, 64, writer_threads=2) == [0, 1, 2, 3]
    assert peak_shards[0] <= 3 and pool._handed_out == 0
    # A limit below one shard's batches could never make progress: refused up front, naming the fix.
    with pytest.raises(ConfigError, match="max_batches_in_flight=1; raise it to at least 2"):
        run_overlapped(extractor, jobs, slow_write, 64, writer_threads=2, max_batches_in_flight=1)
    assert pool._handed_out == 0
