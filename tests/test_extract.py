"""extract.py: hidden-state shards (contract D) hold exactly the target's tensors, and a killed stage resumes exactly."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftline.config import ExtractConfig
from draftline.errors import ConfigError
from draftline.extract import extract_hidden_states, extract_shard
from draftline.hidden_shards import length_buckets, num_hidden_shards
from draftline.store import open_store
from draftline.target import load_target
from draftline.traces import iter_traces

REPO = Path(__file__).resolve().parents[1]


def _shard(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def write_traces(store, run: str, tokenizer, vocab: int, shards: int = 3, per_shard: int = 4, seed: int = 0) -> None:
    """Contract-C traces with a real prompt prefix and random responses of varied length, plus the stage manifest.

    Extraction only needs token ids, so the tests do not wait for the target to generate them."""
    g = torch.Generator().manual_seed(seed)
    entries = []
    for s in range(shards):
        lines = []
        for j in range(per_shard):
            prompt = tokenizer(f"Question {s}.{j}: what does the fox say?")["input_ids"]
            n = int(torch.randint(3, 60, (1,), generator=g))
            response = torch.randint(10, vocab, (n,), generator=g).tolist()
            lines.append(json.dumps({"id": f"p{s}-{j}:0", "prompt_id": f"p{s}-{j}", "input_ids": prompt + response,
                                     "loss_mask": [0] * len(prompt) + [1] * n, "text": ""}))
        entries.append(store.put_bytes(f"{run}/traces/shard-{s:05d}.jsonl", ("\n".join(lines) + "\n").encode()))
    store.write_manifest(f"{run}/traces", entries)


@pytest.fixture(scope="module")
def traced(tmp_path_factory, target_dirs):
    """Traces for both targets in one local store: (store, root); runs are named after the targets."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("extract-store")
    store = open_store(str(root))
    for kind, path in target_dirs.items():
        tok = AutoTokenizer.from_pretrained(path)
        write_traces(store, kind, tok, tok.vocab_size)
    return store, root


def _copy_traces(src, src_run: str, dst, dst_run: str) -> None:
    for key in src.list(f"{src_run}/traces"):
        dst.put_bytes(f"{dst_run}/traces/" + key.split("/traces/", 1)[1], src.get_bytes(key))


def test_shards_hold_exactly_the_targets_hidden_states_on_both_targets(traced, target_dirs):
    store, root = traced
    # Small batches and shards: several padded batches per shard, several shards.
    cfg = ExtractConfig(batch_tokens=96, tokens_per_shard=160)
    for kind, path in target_dirs.items():
        result = extract_hidden_states(cfg, path, store, kind)
        assert result["shards"] > 1 and result["computed_shards"] == list(range(result["shards"]))
        model, _ = load_target(path, "bfloat16", "cpu")
        L, H = model.config.num_hidden_layers, model.config.hidden_size
        ids = result["aux_layer_ids"]
        assert ids == [2, L // 2, L - 3]
        traces = {t["id"]: t for t in iter_traces(store, kind)}
        seen = []
        manifest = store.read_manifest(f"{kind}/hidden")
        for entry in manifest:
            t, meta = _shard(root / entry.key)
            assert json.loads(meta["aux_layer_ids"]) == ids and meta["convention"] == "vllm"
            assert meta["target_fingerprint"] == result["target_fingerprint"]
            assert t["aux_hidden_states"].dtype == torch.bfloat16 and t["last_hidden_states"].dtype == torch.bfloat16
            assert t["input_ids"].dtype == torch.int64 and t["loss_mask"].dtype == torch.uint8
            cu = t["cu_seqlens"].tolist()
            n = cu[-1]
            assert t["aux_hidden_states"].shape == (n, 3 * H) and t["last_hidden_states"].shape == (n, H)
            assert entry.metadata["tokens"] == n and entry.metadata["sequences"] == len(cu) - 1
            order = json.loads(meta["trace_ids"])
            seqs = [traces[i]["input_ids"] for i in order]
            for s, (a, b) in enumerate(zip(cu, cu[1:])):
                assert t["input_ids"][a:b].tolist() == seqs[s]
                assert t["loss_mask"][a:b].tolist() == traces[order[s]]["loss_mask"]
            # Exact: the same padded batches through transformers with output_hidden_states=True.
            for batch in length_buckets([len(s) for s in seqs], cfg.batch_tokens):
                width = max(len(seqs[i]) for i in batch)
                x = torch.zeros((len(batch), width), dtype=torch.long)
                for r, i in enumerate(batch):
                    x[r, : len(seqs[i])] = torch.tensor(seqs[i])
                with torch.no_grad():
                    ref = model(x, output_hidden_states=True).hidden_states
                for r, i in enumerate(batch):
                    a, b, m = cu[i], cu[i + 1], len(seqs[i])
                    for slot, k in enumerate(ids):
                        assert torch.equal(t["aux_hidden_states"][a:b, slot * H:(slot + 1) * H], ref[k][r, :m]), (kind, k)
                    assert torch.equal(t["last_hidden_states"][a:b], ref[L][r, :m])
            # Padding never leaks: each sequence alone gives the same states up to bf16 rounding.
            a, b = cu[-2], cu[-1]
            with torch.no_grad():
                alone = model(torch.tensor([seqs[-1]]), output_hidden_states=True).hidden_states
            torch.testing.assert_close(t["aux_hidden_states"][a:b, :H], alone[ids[0]][0], atol=0.05, rtol=0.02)
            torch.testing.assert_close(t["last_hidden_states"][a:b], alone[L][0], atol=0.1, rtol=0.05)
            seen += order
        assert sorted(seen) == sorted(traces)  # every trace exactly once


def test_explicit_ids_are_captured_and_recorded(traced, target_dirs, tmp_path):
    store, root = traced
    cfg = ExtractConfig(aux_layer_ids=[6, 1, 3], tokens_per_shard=10_000)
    _copy_traces(store, "llama", store, "llama-ids")
    result = extract_hidden_states(cfg, target_dirs["llama"], store, "llama-ids")
    assert result["aux_layer_ids"] == [1, 3, 6] and result["shards"] == 1
    model, _ = load_target(target_dirs["llama"])
    t, meta = _shard(root / "llama-ids/hidden/shard-00000.safetensors")
    assert json.loads(meta["aux_layer_ids"]) == [1, 3, 6]
    H = model.config.hidden_size
    a, b = t["cu_seqlens"][0].item(), t["cu_seqlens"][1].item()
    with torch.no_grad():
        ref = model(t["input_ids"][a:b][None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(t["aux_hidden_states"][a:b, 2 * H:], ref[6][0], atol=0.05, rtol=0.02)


def test_layer_ids_out_of_range_fail_before_anything_is_read(tmp_path, target_dirs):
    store = open_store(str(tmp_path))  # empty: no traces either, yet the ids are reported first
    with pytest.raises(ConfigError) as err:
        extract_hidden_states(ExtractConfig(aux_layer_ids=[2, 4, 99]), target_dirs["llama"], store, "r")
    assert "extract.aux_layer_ids=[2, 4, 99]" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="run trace generation"):
        extract_hidden_states(ExtractConfig(), target_dirs["llama"], store, "r")


def test_length_buckets_respect_the_token_budget():
    lengths = [5, 30, 7, 30, 12, 100, 1]
    batches = length_buckets(lengths, 64)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 64
    assert batches[0] == [5]  # longer than the budget: alone


_KILLER = textwrap.dedent("""
    import os, signal, sys
    from draftline.config import ExtractConfig
    from draftline.extract import extract_hidden_states
    from draftline.store import open_store
    from draftline.target import load_target
    target, root, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = open_store(root)
    model, _ = load_target(target)
    done = [root + f"/k/hidden/_done/shard-{i:05d}.json" for i in range(kill_after + 1)]
    def pre_hook(module, args):
        # A real SIGKILL in the middle of a later shard's forward pass, once shards 0..kill_after are published
        # (parallel writers may finish them in any order).
        if all(map(os.path.exists, done)):
            os.kill(os.getpid(), signal.SIGKILL)
    model.model.layers[3].register_forward_pre_hook(pre_hook)
    extract_hidden_states(ExtractConfig(batch_tokens=64, tokens_per_shard=100), target, store, "k", model=model)
""")


def test_rerun_after_sigkill_keeps_finished_shards_and_matches_a_clean_run(traced, target_dirs, tmp_path):
    store, root = traced
    target = target_dirs["llama"]
    cfg = ExtractConfig(batch_tokens=64, tokens_per_shard=100)
    killed_root = tmp_path / "killed"
    killed = open_store(str(killed_root))
    _copy_traces(store, "llama", killed, "k")
    total = num_hidden_shards(cfg, killed, "k")
    assert total >= 4
    proc = subprocess.run([sys.executable, "-c", _KILLER, str(target), str(killed_root), "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    # Finished = published with a completion record (a shard file without one may be cut off mid-publish).
    finished = sorted(p.name.replace(".json", ".safetensors") for p in (killed_root / "k/hidden/_done").glob("*.json"))
    assert 2 <= len(finished) < total, finished  # killed mid-stage, after shard 1
    assert not (killed_root / "k/hidden/manifest.json").exists()
    before = {n: (killed_root / "k/hidden" / n).stat().st_mtime_ns for n in finished}

    result = extract_hidden_states(cfg, target, killed, "k")
    assert result["computed_shards"] == [i for i in range(total) if f"shard-{i:05d}.safetensors" not in finished]
    assert {n: (killed_root / "k/hidden" / n).stat().st_mtime_ns for n in finished} == before  # not rewritten

    clean = open_store(str(tmp_path / "clean"))
    _copy_traces(killed, "k", clean, "k")
    extract_hidden_states(cfg, target, clean, "k")
    for i in range(total):
        name = f"k/hidden/shard-{i:05d}.safetensors"
        assert (killed_root / name).read_bytes() == (tmp_path / "clean" / name).read_bytes(), name
    assert killed.read_manifest("k/hidden").keys() == clean.read_manifest("k/hidden").keys()

    # A third run computes nothing; a damaged shard is found by its checksum and recomputed alone.
    assert extract_hidden_states(cfg, target, killed, "k")["computed_shards"] == []
    victim = killed_root / "k/hidden/shard-00002.safetensors"
    good = victim.read_bytes()
    victim.write_bytes(good[:-8] + b"\0" * 8)
    assert extract_shard(cfg, target, killed, "k", 2)["computed"] is True
    assert victim.read_bytes() == good
