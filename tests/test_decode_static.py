"""The fast path of the reference decoder (draftline.decode_static) against the eager reference, on CPU.

On CPU it runs "static-eager": the fixed-shape code the GPU captures and replays, without the capture itself.
"""
from __future__ import annotations

import math

import pytest
import torch

from draftline.reference import run_reference
from draftline.speculative import SpeculativeDecoder, plain_decode
from draftline.decode_static import StaticDrafter, StaticTarget, slots_needed, time_call
from draftline.drafter.eagle_format import save_eagle_dir
from draftline.target import load_target
from tests.test_decode import _exact_joint, one_thread, random_drafter, random_prompts, tiny_target  # noqa: F401


def _same_stats(a, b) -> None:
    assert (a.num_drafts, a.num_accepted_tokens, a.accepted_per_position, a.accepted_histogram) == \
           (b.num_drafts, b.num_accepted_tokens, b.accepted_per_position, b.accepted_histogram)


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_static_path_reproduces_plain_greedy_on_the_demo_targets(target_dirs, kind):
    """float32, chat prompts in one ragged batch (left padding), k=3: output equals unbatched eager plain greedy,
    acceptance equals the eager speculative path's with the same drafter."""
    from draftline.traces import encode_prompt, read_prompts
    from tests.fixtures.tiny_targets import ASSETS

    model, tok = load_target(target_dirs[kind], "float32", "cpu")
    prompts = [encode_prompt(tok, p, True) for p in read_prompts(ASSETS / "prompts" / "eval_prompts.jsonl")[:6]]
    assert len({len(p) for p in prompts}) > 1
    drafter = random_drafter(model)
    plain = [plain_decode(model, [p], 16, fast=False).tokens[0] for p in prompts]
    static_plain = plain_decode(model, prompts, 16, fast=True)
    assert static_plain.mode == "static-eager" and static_plain.tokens == plain
    fast = SpeculativeDecoder(model, drafter, k=3, fast=True).generate(prompts, 16)
    eager = SpeculativeDecoder(model, drafter, k=3, fast=False).generate(prompts, 16)
    assert fast.mode == "static-eager" and eager.mode == "eager"
    assert fast.tokens == plain == eager.tokens
    _same_stats(fast.stats, eager.stats)


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_static_path_matches_eager_when_rows_accept_different_lengths(kind):
    """Rows accepting 0..k drafts leave masked holes in the static caches too; batch 1 and ragged batches."""
    model = tiny_target(kind, vocab=6)
    drafter = random_drafter(model, std=0.5)
    prompts = random_prompts(10, 6, seed=2)
    plain = [plain_decode(model, [p], 30, fast=False).tokens[0] for p in prompts]
    for k in (1, 4):
        fast = SpeculativeDecoder(model, drafter, k=k, fast=True).generate(prompts, 30)
        eager = SpeculativeDecoder(model, drafter, k=k, fast=False).generate(prompts, 30)
        assert fast.tokens == plain, f"k={k}"
        _same_stats(fast.stats, eager.stats)
        assert sum(fast.stats.accepted_histogram[1:]) > 0 and fast.stats.accepted_histogram[0] > 0
    decoder = SpeculativeDecoder(model, drafter, k=3, fast=True)
    for p, want in zip(prompts[:3], plain):  # batch 1 reuses one set of buffers across prompts of other lengths
        assert decoder.generate([p], 30).tokens == [want]
    assert decoder.static[0].num_slots >= slots_needed(max(len(p) for p in prompts[:3]), 30, 3, 1)


def test_static_path_stops_at_eos_like_plain_decoding():
    model = tiny_target("llama", vocab=6, seed=5)
    drafter = random_drafter(model, std=0.5)
    prompts = random_prompts(8, 6, seed=6)
    eos = plain_decode(model, prompts[:1], 25, fast=False).tokens[0][5]
    plain = [plain_decode(model, [p], 25, eos_token_ids=[eos], fast=False).tokens[0] for p in prompts]
    assert plain_decode(model, prompts, 25, eos_token_ids=[eos], fast=True).tokens == plain
    spec = SpeculativeDecoder(model, drafter, k=4, eos_token_ids=[eos], fast=True).generate(prompts, 25).tokens
    assert spec == plain and any(len(t) < 25 for t in spec)


def test_greedy_iteration_calls_match_eager_with_a_draft_vocabulary():
    """Temperature 0 runs decode_static's greedy calls (the bodies CUDA captures): drafts mapped through a draft
    vocabulary, ragged rows, the same tokens, acceptance and forward counts as the eager path, and the calls reused."""
    model = tiny_target("llama", vocab=8, seed=3)
    drafter = random_drafter(model, draft_vocab=4, std=0.5)
    prompts = random_prompts(6, 8, seed=4)
    decoder = SpeculativeDecoder(model, drafter, k=3, fast=True)
    fast = decoder.generate(prompts, 30)
    eager = SpeculativeDecoder(model, drafter, k=3, fast=False).generate(prompts, 30)
    assert decoder.static_greedy is not None and fast.mode == "static-eager"
    assert fast.tokens == eager.tokens == [plain_decode(model, [p], 30, fast=False).tokens[0] for p in prompts]
    _same_stats(fast.stats, eager.stats)
    # The static path queues the last iteration's drafter read before it learns the rows are done; the eager one stops.
    assert (fast.target_forwards, fast.drafter_forwards) == (eager.target_forwards, eager.drafter_forwards + 1)
    loop = decoder.static_greedy
    assert decoder.generate(prompts, 30).tokens == fast.tokens and decoder.static_greedy is loop
    plain = plain_decode(model, prompts, 30, fast=True)
    assert plain.tokens == fast.tokens and model._draftline_plain_static.greedy_step is not None


def test_an_mla_head_decodes_the_same_on_the_static_path_as_on_the_eager_one():
    """An MLA head (keys wider than values) in the static caches: the tokens of plain greedy decoding, and the same
    acceptance as the eager path."""
    model = tiny_target("deepseek", vocab=8, seed=3)
    drafter = random_drafter(model, draft_vocab=4, std=0.5, attention="mla")
    assert drafter.config.head_dim != drafter.config.value_dim
    prompts = random_prompts(6, 8, seed=4)
    fast = SpeculativeDecoder(model, drafter, k=3, fast=True).generate(prompts, 20)
    eager = SpeculativeDecoder(model, drafter, k=3, fast=False).generate(prompts, 20)
    assert fast.mode == "static-eager"
    assert fast.tokens == eager.tokens == [plain_decode(model, [p], 20, fast=False).tokens[0] for p in prompts]
    _same_stats(fast.stats, eager.stats)
    assert eager.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("draft_sampling", ["greedy", "probabilistic"])
def test_static_sampling_draws_what_the_eager_path_draws(draft_sampling):
    """Same generator, same order of draws, same probabilities: the same samples and acceptance, row by row."""
    model = tiny_target("llama", vocab=6, seed=11)
    drafter = random_drafter(model, seed=12, std=0.5)
    prompts = random_prompts(12, 6, seed=9)
    kwargs = dict(k=2, temperature=0.8, seed=13, draft_sampling=draft_sampling)
    fast = SpeculativeDecoder(model, drafter, fast=True, **kwargs).generate(prompts, 12)
    eager = SpeculativeDecoder(model, drafter, fast=False, **kwargs).generate(prompts, 12)
    assert fast.tokens == eager.tokens
    _same_stats(fast.stats, eager.stats)
    assert 0 < fast.stats.num_accepted_tokens < fast.stats.num_draft_tokens
    assert plain_decode(model, prompts, 12, temperature=0.8, seed=3, fast=True).tokens == \
           plain_decode(model, prompts, 12, temperature=0.8, seed=3, fast=False).tokens


def test_static_sampling_reproduces_the_target_distribution():
    """tests/test_decode.py's distribution test (see its bound) through the fast path, probabilistic drafts."""
    vocab, temp, n = 6, 0.8, 20000
    model = tiny_target("llama", vocab=vocab, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    drafter = random_drafter(model, seed=12, std=0.5)
    prompt = [1, 4, 2, 5, 0]
    exact = _exact_joint(model, prompt, vocab, temp).flatten().double()
    gen = SpeculativeDecoder(model, drafter, k=2, temperature=temp, seed=14, draft_sampling="probabilistic",
                             fast=True).generate([prompt] * n, 3)
    assert gen.mode == "static-eager" and all(len(t) == 3 for t in gen.tokens)
    codes = torch.tensor([a * vocab * vocab + b * vocab + c for a, b, c in gen.tokens])
    empirical = torch.bincount(codes, minlength=vocab ** 3).double() / n
    bound = 0.5 * torch.sqrt(exact * (1 - exact) / n).sum().item() + math.sqrt(math.log(1e6) / (2 * n))
    tv = 0.5 * (empirical - exact).abs().sum().item()
    assert tv < bound, f"TV {tv:.4f} >= bound {bound:.4f}"
    assert gen.stats.accepted_per_position[1] > 0


def test_a_failed_capture_falls_back_to_static_eager_and_says_why():
    """Asking for graphs where capture cannot work (here: no CUDA) keeps decoding right, without graphs."""
    model = tiny_target("llama", vocab=6)
    drafter = random_drafter(model, std=0.5)
    target = StaticTarget(model, drafter.config.aux_layer_ids, 2, 128, lengths=(4,), use_graphs=True)
    heads = StaticDrafter(drafter, 2, 128, 4, use_graphs=True)
    assert target.capture_error and heads.capture_error
    assert not target.graphs and not heads.graphs
    decoder = SpeculativeDecoder(model, drafter, k=3, fast=True)
    decoder.static = (target, heads)
    prompts = random_prompts(2, 6, seed=3, hi=10)
    gen = decoder.generate(prompts, 20)
    assert gen.mode == "static-eager" and decoder.static[0] is target  # the buffers were big enough to reuse
    assert gen.tokens == [plain_decode(model, [p], 20, fast=False).tokens[0] for p in prompts]


def test_step_timing_uses_the_decoding_calls():
    model = tiny_target("llama", vocab=6)
    decoder = SpeculativeDecoder(model, random_drafter(model), k=3, fast=True)
    decoder.generate([[1, 2, 3]], 8)
    target, drafter = decoder.static
    assert time_call(drafter.step, repeats=5, warmup=1) > 0 and time_call(target.calls[4], repeats=5, warmup=1) > 0


def test_reference_names_the_mode_it_ran(target_dirs, tmp_path):
    from tests.fixtures.tiny_targets import ASSETS

    model, tok = load_target(target_dirs["llama"], "float32", "cpu")
    save_eagle_dir(random_drafter(model), tmp_path / "drafter", convention="sglang", include_embeddings=False)
    summary = run_reference(target_dirs["llama"], tmp_path / "drafter", ASSETS / "prompts" / "eval_prompts.jsonl",
                            k=3, max_new_tokens=8, device="cpu", max_prompts=2, fast=True, target=(model, tok)).summary()
    assert summary["mode"] == "static-eager" and summary["plain_mode"] == "static-eager"
    assert summary["greedy_outputs_match"] is True


def test_the_benchmark_measures_the_fast_path_with_its_own_calls():
    """benchmarks/decode.py's measure on the static path: the code a GPU run executes, capture aside."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "decode.py"
    spec = importlib.util.spec_from_file_location("benchmark_decode", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = tiny_target("llama", vocab=6)
    prompts = random_prompts(2, 6, seed=4)
    r = bench.measure(model, random_drafter(model, std=0.5), prompts, 3, 12, [], torch.device("cpu"), fast=True,
                      time_repeats=3)
    assert r["mode"] == ["plain:static-eager", "spec:static-eager"] and r["greedy_outputs_match"] is True
    assert r["c"] > 0 and r["drafter_call_ms"] > 0 and r["target_step_ms"] > 0 and r["verify_step_ms"] > 0
    assert r["bound"] == pytest.approx(r["tau"] / (1 + 3 * r["c"]))


# ---------------------------------------------------------------- sync windows: several greedy steps per host sync

def _run_with_sync_windows(model, drafter, prompts, max_new_tokens, eos, k=3):
    """{sync_every: (plain Generation, speculative Generation)} on the greedy fast path."""
    out = {}
    for sync_every in (1, 3, 8):
        plain = plain_decode(model, prompts, max_new_tokens, eos_token_ids=eos, fast=True, sync_every=sync_every)
        spec = SpeculativeDecoder(model, drafter, k=k, eos_token_ids=eos, fast=True,
                                  sync_every=sync_every).generate(prompts, max_new_tokens)
        assert plain.mode == spec.mode == "static-eager"
        out[sync_every] = plain, spec
    return out


def _same_as_one_sync_per_step(runs, want_tokens, eager_spec) -> None:
    """Every sync_every: the tokens of unbatched eager plain greedy, the eager path's acceptance, and the forward
    counts of sync_every=1 (steps run past the end are discarded, not counted)."""
    plain1, spec1 = runs[1]
    assert plain1.discarded_target_forwards == spec1.discarded_target_forwards == 0
    for sync_every, (plain, spec) in runs.items():
        assert plain.tokens == spec.tokens == want_tokens, f"sync_every={sync_every}"
        _same_stats(spec.stats, eager_spec.stats)
        assert plain.target_forwards == plain1.target_forwards, f"sync_every={sync_every}"
        assert (spec.target_forwards, spec.drafter_forwards) == (spec1.target_forwards, spec1.drafter_forwards)


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_sync_windows_reproduce_plain_greedy_on_the_demo_targets(target_dirs, kind):
    """Ragged chat batch, an EOS that stops one row mid-run and max_new_tokens=13 (not a multiple of 3 or 8)."""
    from draftline.traces import encode_prompt, read_prompts
    from tests.fixtures.tiny_targets import ASSETS

    model, tok = load_target(target_dirs[kind], "float32", "cpu")
    prompts = [encode_prompt(tok, p, True) for p in read_prompts(ASSETS / "prompts" / "eval_prompts.jsonl")[:3]]
    drafter = random_drafter(model)
    eos = [plain_decode(model, prompts[:1], 13, fast=False).tokens[0][4]]
    plain = [plain_decode(model, [p], 13, eos_token_ids=eos, fast=False).tokens[0] for p in prompts]
    assert len(plain[0]) < 13
    eager = SpeculativeDecoder(model, drafter, k=3, eos_token_ids=eos, fast=False).generate(prompts, 13)
    _same_as_one_sync_per_step(_run_with_sync_windows(model, drafter, prompts, 13, eos), plain, eager)


@pytest.mark.parametrize("k", [1, 4])
def test_sync_windows_discard_steps_after_eos_and_max_new_tokens(k):
    """Rows accepting 0..k drafts, EOS and max_new_tokens falling inside a window (and a window longer than the
    whole run: max_new_tokens 2 < sync_every); batch 1 and a ragged batch."""
    model = tiny_target("llama", vocab=6, seed=5)
    drafter = random_drafter(model, std=0.5)
    prompts = random_prompts(6, 6, seed=6)
    eos = [plain_decode(model, prompts[:1], 25, fast=False).tokens[0][5]]
    discarded = 0
    for max_new_tokens, eos_ids in ((2, []), (11, []), (25, eos)):
        plain = [plain_decode(model, [p], max_new_tokens, eos_token_ids=eos_ids, fast=False).tokens[0]
                 for p in prompts]
        for batch in (prompts[:1], prompts):
            eager = SpeculativeDecoder(model, drafter, k=k, eos_token_ids=eos_ids, fast=False).generate(
                batch, max_new_tokens)
            runs = _run_with_sync_windows(model, drafter, batch, max_new_tokens, eos_ids, k=k)
            _same_as_one_sync_per_step(runs, plain[:len(batch)], eager)
            discarded += sum(p.discarded_target_forwards + s.discarded_target_forwards for p, s in runs.values())
        if eos_ids:
            assert any(len(t) < max_new_tokens for t in plain)
    assert discarded > 0  # some windows did run past the end


def test_a_sync_window_never_runs_past_the_caches():
    """Windows are cut to the steps the slowest active row can still need and to the slots left; no room is an
    error before any write (an out-of-range write would kill a CUDA context)."""
    from draftline.ragged_batch import RowOutputs
    from draftline.speculative import _window, resolve_sync_every
    from draftline.errors import ConfigError

    rows = RowOutputs(2, max_new_tokens=10, eos_ids=[])
    rows.emit(0, [1] * 7)
    rows.emit(1, [1] * 4)
    assert _window(rows, 8, free_slots=100, slots_per_step=4) == 6  # row 1 needs at most 6 more steps
    rows.emit(1, [1] * 6)
    assert rows.active == [True, False] and _window(rows, 8, 100, 4) == 3
    assert _window(rows, 8, free_slots=9, slots_per_step=4) == 2
    with pytest.raises(RuntimeError, match="caches full"):
        _window(rows, 8, free_slots=3, slots_per_step=4)
    assert slots_needed(10, 20, 3, 1, sync_every=8) == slots_needed(10, 20, 3, 1) + 7 * 4
    assert resolve_sync_every(None, "cpu") == 1 and resolve_sync_every(None, "cuda") == 8
    with pytest.raises(ConfigError):
        resolve_sync_every(0, "cpu")
