"""target.py and aux_ids.py: loading, the vLLM/SGLang layer-id conventions, and hooks that capture exactly the right
tensors."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftline.aux_ids import (
    AuxLayerIds, config_aux_layer_ids, default_aux_layer_ids, from_convention, outside, same_layers, sglang_to_vllm,
    to_convention, vllm_to_sglang,
)
from draftline.errors import ConfigError
from draftline.target import capture_hidden_states, decoder_layers, load_target, num_layers, target_fingerprint


@given(st.integers(min_value=7, max_value=4096))
def test_default_ids_are_three_distinct_layer_inputs_for_every_depth(L):
    ids = default_aux_layer_ids(L)
    assert ids == [2, L // 2, L - 3]
    assert AuxLayerIds.for_target(None, L).as_list() == ids  # ascending, distinct, in range
    # SGLang's view of the same tensors is one less; the round trip is the identity.
    assert vllm_to_sglang(ids) == [1, L // 2 - 1, L - 4]
    assert sglang_to_vllm(vllm_to_sglang(ids)) == ids
    assert from_convention(to_convention(ids, "sglang"), "sglang") == ids


def test_aux_layer_ids_hold_three_distinct_vllm_ids_and_convert_only_at_an_engines_edge():
    ids = AuxLayerIds.read([1, 3, 5], "sglang")  # an SGLang export's ids: outputs of layers 1, 3, 5
    assert ids.as_list() == [2, 4, 6] and ids.written("sglang") == [1, 3, 5] and ids.written("vllm") == [2, 4, 6]
    for bad in ([2, 2, 5], [2, 4], [-1, 2, 3]):
        with pytest.raises(ConfigError, match="three distinct non-negative"):
            AuxLayerIds.of(bad)
    with pytest.raises(ConfigError, match="contradict a target with 6 layers"):
        ids.check_fits(6)
    assert ids.shifted(-1) == [1, 3, 5] and outside([-1, 2, 7], 7) == [-1, 7] and outside([-1, 2], 7, "sglang") == []
    assert same_layers([5, 2, 4], [2, 4, 5]) and not same_layers([2, 4, 5], [1, 4, 5])
    with pytest.raises(ConfigError, match="records aux-layer ids in the 'sglang' convention"):
        AuxLayerIds.stored([1, 3, 5], "sglang", "metrics.json", "rerun the training stage")
    assert AuxLayerIds.stored(None, "vllm", "metrics.json", "") is None
    # Where the engines look: eagle_config first (SGLang), then the top level (vLLM's V2 runner, speculators).
    assert config_aux_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]},
                                 "eagle_aux_hidden_state_layer_ids": [2, 4, 6]}) == [1, 3, 5]
    assert config_aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}) == [2, 4, 6]
    assert config_aux_layer_ids({"eagle_config": {}}) is None


def test_three_layer_target_defaults_to_all_layers():
    assert AuxLayerIds.for_target(None, 3).as_list() == [0, 1, 2]  # (2, 1, 0) in ascending order


@given(st.sampled_from([1, 2, 4, 5, 6]))
def test_shallow_targets_need_explicit_ids_and_say_so(L):
    with pytest.raises(ConfigError) as err:
        AuxLayerIds.for_target(None, L)
    msg = str(err.value)
    assert "\n" not in msg
    assert ("set extract.aux_layer_ids" in msg) if L >= 3 else ("at least 3" in msg)


def _tiny_llama(L: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(L)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=L, num_attention_heads=2,
                      num_key_value_heads=2)
    return LlamaForCausalLM(cfg).eval()


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_vllm_id_k_is_input_of_layer_k_and_sglang_id_is_output_of_layer_k(data):
    """For any depth and ids, the tensor captured for vLLM id k is transformers' hidden_states[k] and the output
    (forward hook) of layer vllm_to_sglang(k): the physical meaning of both conventions, checked on a real model."""
    L = data.draw(st.integers(min_value=3, max_value=10), label="layers")
    ids = sorted(data.draw(st.sets(st.integers(0, L - 1), min_size=3, max_size=3), label="vllm ids"))
    model = _tiny_llama(L)
    captured, outputs = {}, {}
    handles = [layer.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
               for i, layer in enumerate(decoder_layers(model))]
    ids_in = torch.randint(0, 64, (2, 7))
    with torch.no_grad(), capture_hidden_states(model, ids, lambda n, h: captured.__setitem__(n, h.clone())):
        ref = model(ids_in, output_hidden_states=True)
    for h in handles:
        h.remove()
    for slot, (k, s) in enumerate(zip(ids, vllm_to_sglang(ids))):
        assert torch.equal(captured[f"aux{slot}"], ref.hidden_states[k])
        if s >= 0:
            assert torch.equal(captured[f"aux{slot}"], outputs[s])
        else:  # vLLM id 0 is the embedding output, which no SGLang id names
            assert k == 0 and torch.equal(captured["aux0"], model.model.embed_tokens(ids_in))
    assert torch.equal(captured["last"], ref.hidden_states[-1])  # after the final norm
    assert torch.allclose(model.lm_head(captured["last"]), ref.logits)


def test_hooks_capture_the_same_tensors_as_output_hidden_states_on_both_targets(target_dirs):
    for kind, path in target_dirs.items():
        model, tok = load_target(path, "bfloat16", "cpu")
        L = num_layers(model)
        ids = AuxLayerIds.for_target(None, L).as_list()
        captured = {}
        batch = torch.randint(5, tok.vocab_size, (2, 12))
        with torch.no_grad(), capture_hidden_states(model, ids, lambda n, h: captured.__setitem__(n, h.clone())):
            ref = model(batch, output_hidden_states=True)
        for slot, k in enumerate(ids):
            got = captured[f"aux{slot}"]
            assert got.dtype == torch.bfloat16 and torch.equal(got, ref.hidden_states[k]), (kind, k)
        assert torch.equal(captured["last"], ref.hidden_states[L]), kind
        # Hooks are removed afterwards: nothing more is captured.
        captured.clear()
        with torch.no_grad():
            model(batch)
        assert captured == {}


def test_ids_out_of_range_fail_with_one_sentence_naming_the_field():
    with pytest.raises(ConfigError) as err:
        AuxLayerIds.for_target([2, 4, 8], 8)
    msg = str(err.value)
    assert "extract.aux_layer_ids=[2, 4, 8]" in msg and "between 0 and 7" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="three distinct"):
        AuxLayerIds.for_target([2, 2, 5], 8)


def test_target_dir_without_config_fails_with_one_sentence(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_target(tmp_path)
    assert "has no config.json" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="no such directory"):
        load_target(tmp_path / "missing")


def test_unsupported_or_weightless_target_fails_with_one_sentence(tmp_path, target_dirs):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        load_target(tmp_path)
    assert "not usable by transformers" in str(err.value) and "\n" not in str(err.value)
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text((target_dirs["llama"] / "config.json").read_text())
    with pytest.raises(ConfigError, match="has no weights"):
        load_target(weightless)


def test_fingerprint_changes_with_weights_and_config(tmp_path, target_dirs):
    import shutil

    src = target_dirs["llama"]
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    assert target_fingerprint(copy) == target_fingerprint(src)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert target_fingerprint(copy) != target_fingerprint(src)
