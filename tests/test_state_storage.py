"""extract.storage: fp8-e4m3 shards hold the demo target's states within e4m3's error bound in at most 0.55 of the
bf16 bytes per token; readers get bf16 back from either storage and from shards written before the option existed;
changing the option recomputes the shards.

The error bound, derived (draftline/state_storage.py): a row x is stored as q = e4m3(x / s), s = amax|x| / 448, so
|x / s| <= 448. e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal scaled value (>= 2^-6) by at most half
a unit in the last place, 2^-4 of itself, and a subnormal one by at most 2^-10 (half of the 2^-9 spacing). So
|x - q s| <= max(2^-4 |x|, 2^-10 s). The reader returns bf16, whose rounding adds at most 2^-9 of the value (of at
most (1 + 2^-4) |x|), so the tests allow (2^-4 + 2^-8) |x| + 2^-10 s per element.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from draftline.config import ExtractConfig, PipelineConfig
from draftline.config_loading import parse_config
from draftline.drafter.data import BatchStream, ShardPart, read_shard_tensors
from draftline.errors import ConfigError
from draftline.extract import extract_hidden_states
from draftline.state_storage import FP8_E4M3, FP8_MAX, dequantize_rows, quantize_rows, quantize_slots
from draftline.store import open_store
from tests.test_extract import write_traces

REPO = Path(__file__).resolve().parents[1]


def _within_bound(restored: torch.Tensor, original: torch.Tensor, scale: torch.Tensor, slots: int) -> torch.Tensor:
    """Elementwise: is |restored - original| within (2^-4 + 2^-8)|x| + 2^-10 s (the module docstring's bound)?"""
    n, width = original.shape
    x = original.float()
    s = scale.float().repeat_interleave(width // slots, dim=1)
    return (restored.float() - x).abs() <= (2.0 ** -4 + 2.0 ** -8) * x.abs() + 2.0 ** -10 * s


def test_round_trip_stays_within_the_e4m3_bound_over_six_decades_and_zero_rows():
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1e-4, 1e-2, 1.0, 30.0, 1e3, 0.0]).repeat_interleave(20).view(-1, 1)
    x = (torch.randn(120, 256, generator=g) * magnitudes).to(torch.bfloat16)
    x[7, 3] = 5e4  # an outlier channel, as in real residual streams: its row's scale follows it
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (120, 1)
    assert q.float().abs().amax() <= FP8_MAX and torch.isfinite(q.float()).all()
    restored = dequantize_rows(q, scale)
    assert restored.dtype == torch.bfloat16
    assert _within_bound(restored, x, scale, 1).all()
    assert torch.equal(restored[100:], torch.zeros(20, 256, dtype=torch.bfloat16))  # zero rows stay zero
    # Per token, the relative L2 error is far below the elementwise bound's 2^-4: about 2^-6 for Gaussian rows.
    rel = ((restored[:100].float() - x[:100].float()).norm(dim=1) / x[:100].float().norm(dim=1))
    assert rel.max() < 2.0 ** -4 and rel.median() < 2.0 ** -5


def test_slots_get_one_scale_each():
    a = torch.cat([torch.randn(4, 8), 1000 * torch.randn(4, 8), torch.zeros(4, 8)], dim=1).to(torch.bfloat16)
    q, scale = quantize_slots(a, 3)
    assert scale.shape == (4, 3) and torch.equal(scale[:, 2], torch.ones(4))
    assert _within_bound(dequantize_rows(q, scale), a, scale, 3).all()


def _shard_files(root: Path, run: str) -> list[Path]:
    return sorted((root / run / "hidden").glob("shard-*.safetensors"))


def _raw(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.fixture(scope="module")
def both_storages(tmp_path_factory, target_dirs):
    """The same traces of the demo Llama extracted once per storage: (root, store, results by storage)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("storage-store")
    store = open_store(str(root))
    tok = AutoTokenizer.from_pretrained(target_dirs["llama"])
    results = {}
    for storage in ("bf16", FP8_E4M3):
        write_traces(store, storage, tok, tok.vocab_size, per_shard=6)
        cfg = ExtractConfig(batch_tokens=256, tokens_per_shard=400, storage=storage)
        results[storage] = extract_hidden_states(cfg, target_dirs["llama"], store, storage)
    return root, store, results


def test_fp8_shards_of_the_demo_target_take_at_most_0_55_of_the_bf16_bytes_per_token(both_storages):
    root, store, results = both_storages
    per_token = {}
    for storage in ("bf16", FP8_E4M3):
        manifest = store.read_manifest(f"{storage}/hidden")
        tokens = sum(e.metadata["tokens"] for e in manifest)
        per_token[storage] = sum(e.size for e in manifest) / tokens
        assert all(e.metadata["storage"] == storage for e in manifest)
        assert results[storage]["storage"] == storage
    # hidden 256: bf16 8 x 256 + 9 = 2057 B; fp8 4 x 256 + 16 (scales) + 9 = 1049 B; plus the header (trace ids)
    assert per_token[FP8_E4M3] / per_token["bf16"] <= 0.55, per_token


def test_fp8_shards_hold_the_bf16_shards_states_within_the_e4m3_bound(both_storages):
    root, store, _ = both_storages
    bf16_files, fp8_files = _shard_files(root, "bf16"), _shard_files(root, FP8_E4M3)
    assert len(bf16_files) == len(fp8_files) > 1
    for pb, pf in zip(bf16_files, fp8_files):
        (b, bm), (f, fm) = _raw(pb), _raw(pf)
        assert bm["storage"] == "bf16" and fm["storage"] == FP8_E4M3
        assert f["aux_hidden_states"].dtype == f["last_hidden_states"].dtype == torch.float8_e4m3fn
        n = b["input_ids"].numel()
        assert f["aux_hidden_states_scale"].shape == (n, 3) and f["last_hidden_states_scale"].shape == (n, 1)
        for key in ("input_ids", "loss_mask", "cu_seqlens"):
            assert torch.equal(b[key], f[key]), key
        assert json.loads(bm["trace_ids"]) == json.loads(fm["trace_ids"])
        # The hooks quantize exactly the bf16 values the bf16 shard stores (the same deterministic CPU forward).
        read = read_shard_tensors(store, f"{FP8_E4M3}/hidden/{pf.name}")
        assert set(read) == {"input_ids", "loss_mask", "cu_seqlens", "aux_hidden_states", "last_hidden_states"}
        for name, slots in (("aux_hidden_states", 3), ("last_hidden_states", 1)):
            assert read[name].dtype == torch.bfloat16 and read[name].shape == b[name].shape
            assert _within_bound(read[name], b[name], f[name + "_scale"], slots).all(), name
        assert torch.equal(read_shard_tensors(store, f"bf16/hidden/{pb.name}")["aux_hidden_states"],
                           b["aux_hidden_states"])


def test_changing_the_storage_recomputes_every_shard_and_a_rerun_recomputes_none(both_storages, target_dirs):
    root, store, results = both_storages
    shards = results["bf16"]["shards"]
    cfg = ExtractConfig(batch_tokens=256, tokens_per_shard=400, storage=FP8_E4M3)
    switched = extract_hidden_states(cfg, target_dirs["llama"], store, "bf16")  # the bf16 run's traces, now fp8
    assert switched["computed_shards"] == list(range(shards))
    assert all(_raw(p)[1]["storage"] == FP8_E4M3 for p in _shard_files(root, "bf16"))
    again = extract_hidden_states(cfg, target_dirs["llama"], store, "bf16")
    assert again["computed_shards"] == []
    back = extract_hidden_states(cfg.model_copy(update={"storage": "bf16"}), target_dirs["llama"], store, "bf16")
    assert back["computed_shards"] == list(range(shards))


def test_shards_written_before_the_option_existed_read_as_before(tmp_path):
    """The layout every earlier draftline wrote: bf16 states and no "storage" metadata."""
    g = torch.Generator().manual_seed(1)
    n, h = 7, 16
    tensors = {"input_ids": torch.arange(n, dtype=torch.int64), "loss_mask": torch.ones(n, dtype=torch.uint8),
               "cu_seqlens": torch.tensor([0, 3, 7]),
               "aux_hidden_states": torch.randn(n, 3 * h, generator=g).to(torch.bfloat16),
               "last_hidden_states": torch.randn(n, h, generator=g).to(torch.bfloat16)}
    meta = {"aux_layer_ids": "[2, 4, 5]", "convention": "vllm", "hidden_size": str(h), "backend": "transformers",
            "last_hidden_state": "final_norm_output", "target_fingerprint": "x", "trace_ids": '["a", "b"]'}
    (tmp_path / "old" / "hidden").mkdir(parents=True)
    save_file(tensors, str(tmp_path / "old" / "hidden" / "shard-00000.safetensors"), metadata=meta)
    store = open_store(str(tmp_path))
    read = read_shard_tensors(store, "old/hidden/shard-00000.safetensors")
    assert read.keys() == tensors.keys() and all(torch.equal(read[k], tensors[k]) for k in tensors)
    stream = BatchStream(store, [ShardPart("old/hidden/shard-00000.safetensors")], 100, 64, seed=0, shuffle=False,
                         epochs=1)
    batch = stream.next_batch()
    stream.close()
    assert [len(s) for s in batch] == [3, 4] and torch.equal(batch[1].aux, tensors["aux_hidden_states"][3:])


def test_a_shard_in_a_storage_this_draftline_does_not_know_is_refused(tmp_path):
    (tmp_path / "r").mkdir()
    save_file({"input_ids": torch.zeros(2, dtype=torch.int64)}, str(tmp_path / "r" / "s.safetensors"),
              metadata={"storage": "int4"})
    with pytest.raises(ConfigError, match="stores its states as 'int4'"):
        read_shard_tensors(open_store(str(tmp_path)), "r/s.safetensors")


def test_a_bad_storage_value_is_refused_in_one_sentence_naming_the_choices():
    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data["extract"]["storage"] = "fp8"
    with pytest.raises(ConfigError) as err:
        parse_config(data, PipelineConfig, "cfg.yaml")
    text = str(err.value)
    assert "extract.storage='fp8'" in text and "'bf16'" in text and "'fp8-e4m3'" in text and "\n" not in text
