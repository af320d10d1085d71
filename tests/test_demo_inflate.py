"""The inflated demo target (GPU benchmarks' >=1B target) computes the demo target's function exactly."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftline.demo.inflate import EIGHT_B_SHAPE, ONE_B_SHAPE, _check, inflate_llama, layer_positions, parameter_count

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo-llama"


@pytest.fixture(scope="module")
def demo():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()


def test_layer_positions_spread_the_demo_layers_from_depth_zero():
    assert layer_positions(8, 16) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert layer_positions(8, 8) == list(range(8))


@pytest.mark.parametrize("shape", [dict(hidden_size=768, intermediate_size=1024, num_hidden_layers=12,
                                        num_attention_heads=12, num_key_value_heads=4, head_dim=64),
                                   dict(hidden_size=512, intermediate_size=640, num_hidden_layers=8,
                                        num_attention_heads=8, num_key_value_heads=2, head_dim=64)])
def test_an_inflated_target_gives_the_demo_targets_logits_and_greedy_text(demo, shape):
    big = inflate_llama(demo, shape, dtype=torch.float32)
    assert sum(p.numel() for p in big.parameters()) > sum(p.numel() for p in demo.parameters())
    ids = torch.tensor([[1, 5, 300, 77, 1024, 9, 12, 3000, 41, 42, 43, 44]])
    with torch.no_grad():
        want, got = demo(ids).logits, big(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    small_text = demo.generate(ids, max_new_tokens=24, do_sample=False)
    big_text = big.generate(ids, max_new_tokens=24, do_sample=False)
    assert big_text.tolist() == small_text.tolist()


def test_parameter_count_matches_the_model_and_the_shapes_are_their_sizes(demo):
    assert parameter_count(demo.config.to_dict()) == sum(p.numel() for p in demo.parameters())
    base = demo.config.to_dict()
    assert 1.0e9 <= parameter_count({**base, **ONE_B_SHAPE}) < 1.1e9
    assert 6.5e9 <= parameter_count({**base, **EIGHT_B_SHAPE}) < 8.1e9
    _check(demo, EIGHT_B_SHAPE)  # the 8B shape can hold the demo (it is too big to build in a CPU test)


def test_a_shape_that_cannot_hold_the_demo_is_refused(demo):
    with pytest.raises(ValueError, match="head_dim"):
        inflate_llama(demo, dict(head_dim=128))
