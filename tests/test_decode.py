"""The reference speculative decoder: exact greedy equivalence, the sampling distribution, acceptance bookkeeping."""
from __future__ import annotations

import json
import math

import pytest
import torch

from draftline.acceptance import AcceptanceStats, expected_acceptance
from draftline.drafter.eagle_format import save_eagle_dir
from draftline.drafter.model import DrafterCache, Eagle3Drafter
from draftline.drafter.target_sizing import drafter_for_target
from draftline.errors import ConfigError
from draftline.ragged_batch import RaggedDrafter
from draftline.reference import reference_acceptance, run_reference
from draftline.speculative import SpeculativeDecoder, plain_decode
from draftline.target import load_target


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Two cores shared by many processes: one torch thread per process avoids spin-wait contention.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_target(kind: str, vocab: int, seed: int = 0):
    """A random float32 target with a tiny vocabulary, so even a random drafter is accepted now and then."""
    from transformers import DeepseekV3Config, LlamaConfig, LlamaForCausalLM, DeepseekV3ForCausalLM

    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                  max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=128, num_key_value_heads=2, **common))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                           n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32,
                           q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                           num_key_value_heads=4, **common))
    with torch.no_grad():  # the default init is near-uniform; larger embeddings make greedy output less degenerate
        model.get_input_embeddings().weight.normal_(0, 1.0)
    return model.eval()


def random_drafter(model, aux_ids=None, seed: int = 1, draft_vocab: int | None = None, std: float = 0.02,
                   attention: str = "llama") -> Eagle3Drafter:
    """An untrained head; std=0.5 or so makes its guesses depend on the input instead of being nearly constant."""
    from draftline.config import DrafterConfig

    torch.manual_seed(seed)
    cfg = model.config
    n = cfg.num_hidden_layers
    sizes = DrafterConfig(draft_vocab_size=draft_vocab or cfg.vocab_size, attention=attention)
    drafter = drafter_for_target(cfg, sizes, aux_ids or [2, n // 2, n - 3])
    drafter.reset_parameters(std=std)
    if draft_vocab is not None:  # a draft vocabulary of every other token
        used = torch.arange(0, 2 * draft_vocab, 2)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[used] = True
        drafter.set_vocab(used - torch.arange(draft_vocab), t2d)
    drafter.load_target_weights(model.get_input_embeddings().weight)
    return drafter.eval()


def random_prompts(n: int, vocab: int, seed: int, lo: int = 2, hi: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (m,), generator=g).tolist() for m in lengths]


# ---------------------------------------------------------------- greedy equivalence

@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_greedy_output_equals_plain_greedy_on_the_demo_targets(target_dirs, kind):
    """float32, 16 eval prompts through the chat template, batch 8 with left padding, k=3, an untrained drafter."""
    from draftline.traces import encode_prompt, read_prompts
    from tests.fixtures.tiny_targets import ASSETS

    model, tok = load_target(target_dirs[kind], "float32", "cpu")
    prompts = [encode_prompt(tok, p, True) for p in read_prompts(ASSETS / "prompts" / "eval_prompts.jsonl")[:16]]
    assert len({len(p) for p in prompts}) > 1  # ragged lengths: left padding is exercised
    drafter = random_drafter(model)
    plain = [plain_decode(model, [p], 16).tokens[0] for p in prompts]
    spec = SpeculativeDecoder(model, drafter, k=3).generate(prompts[:8], 16).tokens
    spec += SpeculativeDecoder(model, drafter, k=3).generate(prompts[8:], 16).tokens
    assert spec == plain


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_greedy_output_is_exact_when_rows_accept_different_lengths(kind):
    """A 6-token vocabulary makes a random drafter right ~25% of the time: rows of a batch then accept 0..k drafts
    per step and leave masked holes in both KV caches; the output must still equal unbatched plain greedy."""
    model = tiny_target(kind, vocab=6)
    drafter = random_drafter(model, std=0.5)
    prompts = random_prompts(10, 6, seed=2)
    plain = [plain_decode(model, [p], 30).tokens[0] for p in prompts]
    for k in (1, 4):
        gen = SpeculativeDecoder(model, drafter, k=k).generate(prompts, 30)
        assert gen.tokens == plain, f"k={k}"
        hist = gen.stats.accepted_histogram
        assert hist[0] > 0 and sum(hist[1:]) > 0, f"k={k}: acceptance never varied, holes untested: {hist}"
    single = SpeculativeDecoder(model, drafter, k=3).generate(prompts[:1], 30)
    assert single.tokens == plain[:1]


def test_greedy_is_exact_with_a_draft_vocabulary_smaller_than_the_target():
    """Drafts pass through d2t; a draft vocabulary of half the tokens still gives the target's own greedy output."""
    model = tiny_target("llama", vocab=8, seed=3)
    drafter = random_drafter(model, draft_vocab=4, std=0.5)
    prompts = random_prompts(6, 8, seed=4)
    gen = SpeculativeDecoder(model, drafter, k=3).generate(prompts, 30)
    assert gen.tokens == [plain_decode(model, [p], 30).tokens[0] for p in prompts]
    assert gen.stats.num_accepted_tokens > 0
    assert set(drafter.draft_token_ids.tolist()) == {0, 2, 4, 6}


def test_generation_stops_at_eos_and_max_new_tokens_like_plain_decoding():
    model = tiny_target("llama", vocab=6, seed=5)
    drafter = random_drafter(model, std=0.5)
    prompts = random_prompts(8, 6, seed=6)
    eos = plain_decode(model, prompts[:1], 25).tokens[0][5]  # a token the target does produce
    plain = [plain_decode(model, [p], 25, eos_token_ids=[eos]).tokens[0] for p in prompts]
    spec = SpeculativeDecoder(model, drafter, k=4, eos_token_ids=[eos]).generate(prompts, 25).tokens
    assert spec == plain
    assert all(len(t) <= 25 and (t[-1] == eos or len(t) == 25) and eos not in t[:-1] for t in spec)
    assert any(len(t) < 25 for t in spec)  # some row really stopped at EOS


def test_masked_drafter_step_computes_what_the_drafter_forward_computes():
    """decode runs the head with a key mask; without holes it must equal Eagle3Drafter.forward exactly."""
    model = tiny_target("llama", vocab=16)
    drafter = random_drafter(model)
    ids = torch.randint(0, 16, (1, 7))
    hidden = torch.randn(1, 7, 64)
    pos = torch.arange(7)[None]
    ref_logits, ref_hidden, cache = drafter(ids[:, :5], hidden[:, :5], pos[:, :5], DrafterCache())
    ref_logits2, ref_hidden2, _ = drafter(ids[:, 5:], hidden[:, 5:], pos[:, 5:], cache)
    mine = RaggedDrafter(drafter)
    logits, hid = mine.forward(ids[:, :5], hidden[:, :5], pos[:, :5], torch.ones(1, 5, dtype=torch.bool))
    logits2, hid2 = mine.forward(ids[:, 5:], hidden[:, 5:], pos[:, 5:], torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(logits, ref_logits.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits2, ref_logits2.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hid2, ref_hidden2, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- bookkeeping (oracle drafters, labelled as such)

def _constant_argmax(model_or_drafter_head: torch.nn.Linear) -> None:
    # All-zero logits: argmax is token 0 everywhere (ties go to the first index).
    with torch.no_grad():
        model_or_drafter_head.weight.zero_()


def test_oracle_accept_all_bookkeeping():
    """ORACLE, not a real drafter: target and drafter both always pick token 0, so every draft is accepted."""
    model = tiny_target("llama", vocab=16)
    drafter = random_drafter(model)
    _constant_argmax(model.lm_head)
    _constant_argmax(drafter.lm_head)
    k, new = 3, 30
    gen = SpeculativeDecoder(model, drafter, k=k).generate(random_prompts(4, 16, seed=7), new)
    steps = math.ceil((new - 1) / (k + 1))  # the prefill gives the first token, each step k + 1
    s = gen.stats
    assert gen.tokens == [[0] * new] * 4
    assert s.num_drafts == 4 * steps and s.num_accepted_tokens == 4 * steps * k
    assert s.mean_acceptance_length == k + 1 and s.per_position_acceptance == [1.0] * k
    assert s.accepted_histogram == [0] * k + [4 * steps]
    assert gen.target_forwards == 1 + steps


def test_oracle_reject_all_bookkeeping():
    """ORACLE: the drafter always proposes token 1, the target always wants token 0: nothing is accepted."""
    model = tiny_target("llama", vocab=16)
    drafter = random_drafter(model)
    _constant_argmax(model.lm_head)
    _constant_argmax(drafter.lm_head)
    drafter.lm_head.register_forward_hook(lambda m, a, out: out + torch.nn.functional.one_hot(
        torch.tensor(1), out.shape[-1]).to(out.dtype))
    gen = SpeculativeDecoder(model, drafter, k=2).generate(random_prompts(3, 16, seed=8), 10)
    assert gen.tokens == [[0] * 10] * 3
    assert gen.stats.num_accepted_tokens == 0 and gen.stats.mean_acceptance_length == 1.0
    assert gen.stats.accepted_histogram == [3 * 9, 0, 0]


def test_acceptance_stats_follow_vllm_definitions():
    s = AcceptanceStats(k=3)
    for accepted in (0, 3, 1, 3):
        s.record(accepted)
    assert s.num_drafts == 4 and s.num_draft_tokens == 12 and s.num_accepted_tokens == 7
    assert s.mean_acceptance_length == 1 + 7 / 4
    assert s.accepted_per_position == [3, 2, 2]
    assert s.per_position_acceptance == [0.75, 0.5, 0.5]
    assert s.conditional_acceptance == [0.75, 2 / 3, 1.0]
    assert s.accepted_histogram == [1, 1, 0, 2]
    assert json.loads(json.dumps(s.summary()))["mean_acceptance_length"] == 2.75


def test_offline_estimate_uses_the_same_definitions():
    from draftline.drafter.ttt import acceptance_length

    est = expected_acceptance([0.8, 0.5, 0.5])
    assert est["per_position_acceptance"] == pytest.approx([0.8, 0.4, 0.2])
    assert est["mean_acceptance_length"] == pytest.approx(2.4)
    assert est["mean_acceptance_length"] == pytest.approx(acceptance_length([0.8, 0.5, 0.5]))
    assert expected_acceptance([0.8, 0.5, 0.5], k=1)["mean_acceptance_length"] == pytest.approx(1.8)
    assert expected_acceptance([0.5], k=3)["per_position_acceptance"] == pytest.approx([0.5, 0.25, 0.125])
    # A stats object whose per-step conditional rates are acc gives the same figures as the estimate.
    s = AcceptanceStats(k=3, num_drafts=10, num_accepted_tokens=14, accepted_per_position=[8, 4, 2])
    assert s.mean_acceptance_length == pytest.approx(expected_acceptance(s.conditional_acceptance)["mean_acceptance_length"])
    with pytest.raises(ConfigError, match="between 0 and 1"):
        expected_acceptance([1.2])


# ---------------------------------------------------------------- sampling

def _exact_joint(model, prompt: list[int], vocab: int, temperature: float) -> torch.Tensor:
    """P(t1, t2, t3) of the target's own sampling at `temperature`, [V, V, V], from full forwards."""
    with torch.no_grad():
        def probs(prefixes):
            logits = model(torch.tensor(prefixes)).logits[:, -1].float()
            return torch.softmax(logits / temperature, -1)
        p1 = probs([prompt])[0]
        p2 = probs([prompt + [a] for a in range(vocab)])  # [V, V]
        p3 = probs([prompt + [a, b] for a in range(vocab) for b in range(vocab)]).view(vocab, vocab, vocab)
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.mark.parametrize("draft_sampling", ["greedy", "probabilistic"])
def test_sampling_reproduces_the_target_distribution(draft_sampling):
    """Rejection sampling must give the target's own distribution whatever the drafter proposes, with drafts
    taken as the drafter's argmax (vLLM's default) or sampled from it.

    Three sampled tokens (216 outcomes of a 6-token vocabulary) at temperature 0.8, N = 20000 rows of one prompt
    in one ragged batch, k = 2 (so both the first and the chained second draft are verified).
    Bound on the total-variation distance between the empirical and the exact distribution p of N samples:
    E[TV] <= 0.5 * sum_i sqrt(p_i (1 - p_i) / N) (Jensen, per outcome), and TV exceeds its mean by t with
    probability <= exp(-2 N t^2) (McDiarmid, one sample moves TV by at most 1/N); t is taken for probability
    1e-6, which gives about 0.049 here. The seed is fixed, so the test is deterministic; a correct sampler
    would fail it for fewer than one seed in a million.
    """
    vocab, temp, n = 6, 0.8, 20000
    model = tiny_target("llama", vocab=vocab, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions: a temperature error is then far above the bound
    drafter = random_drafter(model, seed=12, std=0.5)
    prompt = [1, 4, 2, 5, 0]
    exact = _exact_joint(model, prompt, vocab, temp).flatten().double()
    gen = SpeculativeDecoder(model, drafter, k=2, temperature=temp, seed=13,
                             draft_sampling=draft_sampling).generate([prompt] * n, 3)
    assert all(len(t) == 3 for t in gen.tokens)
    codes = torch.tensor([a * vocab * vocab + b * vocab + c for a, b, c in gen.tokens])
    empirical = torch.bincount(codes, minlength=vocab ** 3).double() / n
    bound = 0.5 * torch.sqrt(exact * (1 - exact) / n).sum().item() + math.sqrt(math.log(1e6) / (2 * n))
    tv = 0.5 * (empirical - exact).abs().sum().item()
    assert tv < bound, f"TV {tv:.4f} >= bound {bound:.4f}"
    # The bound has power: sampling the same target at temperature 1 instead would be caught.
    other = _exact_joint(model, prompt, vocab, 1.0).flatten().double()
    assert 0.5 * (other - exact).abs().sum().item() > 2 * bound
    s = gen.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # both acceptance and rejection paths were taken
    assert s.accepted_per_position[1] > 0  # the chained second draft was accepted sometimes too


def test_sampling_acceptance_rate_of_the_first_draft_is_the_overlap_of_p_and_q():
    """Standard rejection sampling accepts draft 1 with probability sum_x min(p(x), q(x)) (Leviathan et al.)."""
    vocab, temp, n = 6, 1.0, 10000
    model = tiny_target("llama", vocab=vocab, seed=21)
    drafter = random_drafter(model, seed=22, std=0.5)
    prompt = [3, 1, 4, 1, 5]
    decoder = SpeculativeDecoder(model, drafter, k=1, temperature=temp, seed=23, draft_sampling="probabilistic")
    gen = decoder.generate([prompt] * n, 2)  # the first step decides draft 1 after the sampled first token
    # Exact overlap, averaged over the first token: run the prefill pieces for each possible first token.
    from draftline.ragged_batch import RaggedTarget

    overlaps = []
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temp, -1)
        for t1 in range(vocab):
            tgt = RaggedTarget(model, drafter.config.aux_layer_ids)
            ids = torch.tensor([prompt + [t1]])
            logits, aux = tgt.forward(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool))
            p = torch.softmax(logits[0, -1] / temp, -1)
            nxt = torch.tensor([prompt[1:] + [t1]])
            d_logits, _ = RaggedDrafter(drafter).forward(nxt, drafter.fc(aux[:, :-1]), torch.arange(len(prompt))[None],
                                                    torch.ones_like(nxt, dtype=torch.bool))
            q = torch.zeros(vocab).index_copy_(0, drafter.draft_token_ids, torch.softmax(d_logits[0, -1] / temp, -1))
            overlaps.append(torch.minimum(p, q).sum())
    expected = float((p1 * torch.stack(overlaps)).sum())
    rate = gen.stats.per_position_acceptance[0]
    assert gen.stats.num_drafts == n
    assert abs(rate - expected) < 5 * math.sqrt(expected * (1 - expected) / n) + 1e-3, (rate, expected)


# ---------------------------------------------------------------- reference_acceptance (files in, JSON out)

@pytest.fixture(scope="module")
def untrained_drafter_dir(target_dirs, tmp_path_factory):
    model, _ = load_target(target_dirs["llama"], "float32", "cpu")
    out = tmp_path_factory.mktemp("drafter") / "sglang"
    save_eagle_dir(random_drafter(model), out, convention="sglang", include_embeddings=False)
    return out


def test_reference_acceptance_reports_acceptance_and_speedup_in_one_run(target_dirs, untrained_drafter_dir):
    from tests.fixtures.tiny_targets import ASSETS

    summary = reference_acceptance(target_dirs["llama"], untrained_drafter_dir, ASSETS / "prompts" / "eval_prompts.jsonl",
                                   k=3, max_new_tokens=12, device="cpu", dtype="float32", max_prompts=3)
    json.dumps(summary)  # JSON-ready
    assert summary["num_prompts"] == 3 and summary["k"] == 3
    assert summary["greedy_outputs_match"] is True
    assert summary["num_drafts"] >= 1 and len(summary["per_position_acceptance"]) == 3
    assert sum(summary["accepted_histogram"]) == summary["num_drafts"]
    assert summary["mean_acceptance_length"] == pytest.approx(1 + summary["num_accepted_tokens"] / summary["num_drafts"])
    assert summary["spec_tokens"] == summary["plain_tokens"] > 0
    assert summary["speedup"] == pytest.approx(summary["spec_tokens_per_s"] / summary["plain_tokens_per_s"])
    assert summary["speedup"] > 0


def test_reference_measures_the_same_drafter_fed_neighbouring_layers_and_skips_shifts_outside_the_target(
        target_dirs, untrained_drafter_dir):
    from tests.fixtures.tiny_targets import ASSETS

    summary = reference_acceptance(target_dirs["llama"], untrained_drafter_dir, ASSETS / "prompts" / "eval_prompts.jsonl",
                                   k=3, max_new_tokens=12, device="cpu", dtype="float32", max_prompts=4,
                                   aux_shifts=[-1, 6])
    sglang_ids = json.loads((untrained_drafter_dir / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]
    below, beyond = summary["aux_shift_acceptance"]
    # The -1 shift feeds exactly the layers an SGLang-convention id list names when vLLM reads it.
    assert below["shift"] == -1 and below["aux_layer_ids"] == sglang_ids
    assert below["mean_acceptance_length"] >= 1.0 and "skipped" not in below
    assert beyond["shift"] == 6 and "outside the target's 0..7" in beyond["skipped"]
    assert summary["other_precision_acceptance"] is None  # not asked
    # No shifts asked: no extra decodes, an empty list.
    plain = reference_acceptance(target_dirs["llama"], untrained_drafter_dir, ASSETS / "prompts" / "eval_prompts.jsonl",
                                 k=3, max_new_tokens=4, device="cpu", dtype="float32", max_prompts=1)
    assert plain["aux_shift_acceptance"] == []
    # The same decode in bf16 on copies: how far numerics alone move acceptance; the caller's target stays fp32.
    model, tokenizer = load_target(target_dirs["llama"], "float32", "cpu")
    other = reference_acceptance(target_dirs["llama"], untrained_drafter_dir, ASSETS / "prompts" / "eval_prompts.jsonl",
                                 k=3, max_new_tokens=8, device="cpu", dtype="float32", max_prompts=2,
                                 other_precision=True, target=(model, tokenizer))
    assert other["other_precision_acceptance"]["dtype"] == "bfloat16"
    assert other["other_precision_acceptance"]["mean_acceptance_length"] >= 1.0
    assert next(model.parameters()).dtype == torch.float32


def test_reference_samples_in_ragged_batches_when_temperature_is_set(target_dirs, untrained_drafter_dir):
    from tests.fixtures.tiny_targets import ASSETS

    result = run_reference(target_dirs["llama"], untrained_drafter_dir, ASSETS / "prompts" / "eval_prompts_raw.jsonl",
                           k=2, max_new_tokens=8, device="cpu", temperature=0.8, max_prompts=4, batch_size=3,
                           use_chat_template=False)
    assert result.greedy_outputs_match is None  # only greedy output has a single right answer
    assert result.num_prompts == 4 and result.batch_size == 3
    assert result.stats.num_draft_tokens == 2 * result.stats.num_drafts > 0
    assert 0 < result.spec_tokens <= 4 * 8


def test_reference_rejects_a_drafter_for_another_target(target_dirs, tmp_path):
    from tests.fixtures.tiny_targets import ASSETS

    other = tiny_target("llama", vocab=16)
    d = tmp_path / "wrong"
    save_eagle_dir(random_drafter(other), d, convention="sglang")
    with pytest.raises(ConfigError, match="vocab_size"):
        run_reference(target_dirs["llama"], d, ASSETS / "prompts" / "eval_prompts.jsonl", max_prompts=1,
                      max_new_tokens=2, device="cpu")
    with pytest.raises(ConfigError, match="config.json"):
        run_reference(target_dirs["llama"], tmp_path / "missing", ASSETS / "prompts" / "eval_prompts.jsonl",
                      max_prompts=1, max_new_tokens=2, device="cpu")
    with pytest.raises(ConfigError, match="dtype"):
        run_reference(target_dirs["llama"], d, [{"id": "a", "prompt": "x"}], dtype="int8", device="cpu")
    with pytest.raises(ConfigError, match="draft_sampling"):
        SpeculativeDecoder(other, random_drafter(other), k=2, draft_sampling="topk")
    with pytest.raises(ConfigError, match="k=0"):
        SpeculativeDecoder(other, random_drafter(other), k=0)
