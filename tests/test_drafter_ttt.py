"""Training-time test: the unrolled training graph computes what decoding computes; the chunked loss is the exact loss."""
import pytest
import torch

from draftline.config import DrafterConfig
from draftline.drafter.model import DrafterCache, Eagle3Drafter
from draftline.drafter.ttt import (SoftCrossEntropy, TTTModel, acceptance_length, target_distribution,
                                     ttt_attention_eager, ttt_attention_flex)
from draftline.drafter.vocab import build_vocab, count_tokens

TARGET = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 50, "rope_theta": 10000.0}


def drafter(seed=0):
    torch.manual_seed(seed)
    return Eagle3Drafter.from_target_config(TARGET, DrafterConfig(draft_vocab_size=50)).eval()


def test_unrolled_steps_equal_decoding_with_a_cache():
    """Step j at slot t must see exactly what a decoder drafting after token t+1 sees: real keys 0..t, own chain."""
    model = drafter()
    n, steps = 10, 3
    ids = torch.randint(0, 50, (1, n))
    aux = torch.randn(1, n, 96)
    ttt = TTTModel(model, torch.randn(50, 32), steps, 8, "eager", torch.float32)
    with torch.no_grad():
        unrolled = list(ttt.unroll(ids, torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None], aux))
        for t in (0, 3, 5):
            cache = DrafterCache()
            _, h, cache = model(ids[:, 1:t + 2], model.fc(aux[:, : t + 1]), torch.arange(t + 1)[None], cache)
            torch.testing.assert_close(h[:, -1], unrolled[0][:, t], atol=1e-5, rtol=1e-5)
            h = h[:, -1:]
            for j in range(1, steps):
                _, h, cache = model(ids[:, t + 1 + j: t + 2 + j], h, torch.tensor([[t + j]]), cache)
                torch.testing.assert_close(h[:, 0], unrolled[j][:, t], atol=1e-5, rtol=1e-5)


def test_packed_sequences_do_not_see_each_other():
    model = drafter()
    a, b = torch.randint(0, 50, (1, 6)), torch.randint(0, 50, (1, 5))
    aux_a, aux_b = torch.randn(1, 6, 96), torch.randn(1, 5, 96)
    ttt = TTTModel(model, torch.randn(50, 32), 2, 8, "eager", torch.float32)
    with torch.no_grad():
        packed = list(ttt.unroll(torch.cat([a, b], 1), torch.tensor([[0] * 6 + [1] * 5]),
                                 torch.cat([torch.arange(6), torch.arange(5)])[None], torch.cat([aux_a, aux_b], 1)))
        alone = list(ttt.unroll(b, torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None], aux_b))
    # Slots whose next tokens stay inside sequence b (the last step-j slots read padding after it).
    torch.testing.assert_close(packed[0][:, 6:10], alone[0][:, :4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[1][:, 6:9], alone[1][:, :3], atol=1e-5, rtol=1e-5)


def test_flex_attention_matches_the_eager_ttt_attention():
    torch.manual_seed(0)
    r, t = 2, 20
    q = torch.randn(r, 4, t, 16)
    ks = [torch.randn(r, 2, t, 16) for _ in range(3)]
    vs = [torch.randn(r, 2, t, 16) for _ in range(3)]
    doc = torch.tensor([[0] * 12 + [1] * 8, [0] * 20])
    torch.testing.assert_close(ttt_attention_flex(q, ks, vs, doc), ttt_attention_eager(q, ks, vs, doc),
                               atol=1e-4, rtol=1e-4)


def test_chunked_soft_cross_entropy_equals_the_plain_formula_and_gradient():
    torch.manual_seed(0)
    x = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 16, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(37, 11, dtype=torch.float64), -1)
    loss, preds = SoftCrossEntropy.apply(x, w, p, 5)
    plain = -(p * torch.log_softmax(x @ w.t(), -1)).sum()
    torch.testing.assert_close(loss.double(), plain)
    assert torch.equal(preds, (x @ w.t()).argmax(-1))
    gx, gw = torch.autograd.grad(2.5 * loss, (x, w))
    px, pw = torch.autograd.grad(2.5 * plain, (x, w))
    torch.testing.assert_close(gx, px)
    torch.testing.assert_close(gw, pw)


def test_target_distribution_is_renormalised_over_the_draft_vocabulary_in_chunks():
    torch.manual_seed(0)
    last, head = torch.randn(9, 8), torch.randn(20, 8)
    draft_ids = torch.tensor([1, 4, 5, 19])
    t2d = torch.zeros(20, dtype=torch.bool)
    t2d[draft_ids] = True
    probs, in_vocab, argmax = target_distribution(last, head, draft_ids, t2d, 4, torch.float32)
    logits = last @ head.t()
    torch.testing.assert_close(probs, torch.softmax(logits[:, draft_ids], -1))
    assert torch.equal(argmax, logits.argmax(-1)) and torch.equal(in_vocab, t2d[logits.argmax(-1)])


def test_draft_vocabulary_takes_the_most_frequent_response_tokens_sorted():
    ids = torch.tensor([7, 7, 7, 3, 3, 9, 1, 1, 1, 1, 5])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1])  # token 1 only in the prompt: not counted
    counts = count_tokens(ids, mask, 12)
    d2t, t2d, report = build_vocab(counts, 3)
    used = torch.arange(3) + d2t
    assert used.tolist() == [3, 5, 7] or used.tolist() == [3, 7, 9]
    assert used.tolist() == [3, 5, 7]  # ties (5 and 9 once each) go to the lower id
    assert t2d.nonzero().squeeze(1).tolist() == [3, 5, 7]
    assert report.filled_tokens == 0 and report.coverage == pytest.approx(6 / 7)


def test_fewer_distinct_tokens_than_the_draft_vocabulary_fill_with_lowest_unused_ids():
    counts = count_tokens(torch.tensor([8, 8, 4]), torch.tensor([1, 1, 1]), 10)
    d2t, t2d, report = build_vocab(counts, 5)
    assert (torch.arange(5) + d2t).tolist() == [0, 1, 2, 4, 8]
    assert report.distinct_tokens == 2 and report.filled_tokens == 3
    assert "only 2 distinct ids occurred" in report.message


def test_acceptance_length_estimate():
    assert acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert acceptance_length([0.0, 0.9]) == 1.0
