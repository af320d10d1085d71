"""Training-time test: the unrolled training graph computes what decoding computes; the chunked loss is the exact loss."""
import shutil

import pytest
import torch

from draftline.config import DrafterConfig
from draftline.drafter import speed
from draftline.drafter.model import DrafterCache
from draftline.drafter.target_sizing import drafter_for_target
from draftline.drafter.ttt import (SoftCrossEntropy, TTTModel, acceptance_length, target_distribution,
                                     ttt_attention_eager, ttt_attention_flex)
from draftline.drafter.vocab import build_vocab, count_tokens

TARGET = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 50, "rope_theta": 10000.0}


# An MLA target's sizes (DeepSeek-V3's layout, scaled down) for the MLA head (drafter.attention: mla).
MLA_TARGET = {**TARGET, "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 24, "qk_nope_head_dim": 8,
              "qk_rope_head_dim": 8, "v_head_dim": 6}


def drafter(seed=0, attention="llama"):
    torch.manual_seed(seed)
    target = MLA_TARGET if attention == "mla" else TARGET
    return drafter_for_target(target, DrafterConfig(draft_vocab_size=50, attention=attention)).eval()


@pytest.mark.parametrize("attention", ["llama", "mla"])
def test_unrolled_steps_equal_decoding_with_a_cache(attention):
    """Step j at slot t must see exactly what a decoder drafting after token t+1 sees: real keys 0..t, own chain."""
    model = drafter(attention=attention)
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
    q, ks, vs = random_qkv(r, t, 3)
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


def test_row_weights_drop_rows_from_the_chunked_loss_and_its_gradient():
    torch.manual_seed(0)
    x = torch.randn(23, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 16, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(23, 11, dtype=torch.float64), -1)
    keep = torch.rand(23) > 0.4
    loss, _ = SoftCrossEntropy.apply(x, w, p, 5, None, keep)
    plain = -(p[keep] * torch.log_softmax(x[keep] @ w.t(), -1)).sum()
    torch.testing.assert_close(loss.double(), plain)
    gx, gw = torch.autograd.grad(loss, (x, w))
    px, pw = torch.autograd.grad(plain, (x, w))
    torch.testing.assert_close(gx, px)
    torch.testing.assert_close(gw, pw)
    assert gx[~keep].abs().max() == 0


def test_a_loss_plan_made_on_the_host_gives_the_same_step_as_one_made_in_the_forward():
    """Training makes the plan beside the batch (so the forward never waits for the device); it must change nothing."""
    from draftline.drafter.ttt import loss_plan

    torch.manual_seed(0)
    model = drafter_with_draft_vocab()
    ttt = TTTModel(model, torch.randn(50, 32), 3, 5, "eager", torch.float32).train()
    batch = packed_batch()
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for plan in (None, loss_plan(batch["loss_mask"], batch["doc_ids"], 3)):
        loss_sum, count, hit, total = ttt(**batch, plan=plan)
        grads = torch.autograd.grad((loss_sum / count).sum(), params)
        results.append((loss_sum.detach(), count, hit, total, grads))
    for a, b in zip(results[0][:4], results[1][:4]):
        assert torch.equal(a, b)
    for a, b in zip(results[0][4], results[1][4]):
        assert torch.equal(a, b)


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


# ---- the TTT step against its plain definition ------------------------------------------------------------------
def plain_ttt_step(model, head, steps, input_ids, loss_mask, doc_ids, position_ids, aux, last):
    """Per-step (loss sums, counts, hits, totals) of TTT written out directly: dense masks, full log-softmax."""
    from draftline.drafter.model import apply_rope, rope_cos_sin

    cfg, layer = model.config, model.midlayer
    att, mlp = layer.self_attn, layer.mlp
    r, t = input_ids.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def norm(module, x):
        return module.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps))

    target = last @ head.t()
    target_argmax = target.argmax(-1)
    target_p = torch.softmax(target[..., model.draft_token_ids], -1)
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool).tril() & same_doc  # [R, T, T]
    diagonal = torch.eye(t, dtype=torch.bool).expand(r, t, t)
    hidden = model.fc(aux)
    keys, values, out = [], [], []
    for j in range(steps):
        shift = 1 + j
        tokens = torch.zeros_like(input_ids)
        tokens[:, : t - shift] = input_ids[:, shift:]
        x = torch.cat([norm(layer.input_layernorm, model.embed_tokens(tokens)), norm(layer.hidden_norm, hidden)], -1)
        cos, sin = rope_cos_sin(position_ids + j, hd, cfg.rope_theta, x.dtype)
        q = apply_rope((x @ att.q_proj.weight.t()).view(r, t, nh, hd).transpose(1, 2), cos, sin)
        keys.append(apply_rope((x @ att.k_proj.weight.t()).view(r, t, nkv, hd).transpose(1, 2), cos, sin))
        values.append((x @ att.v_proj.weight.t()).view(r, t, nkv, hd).transpose(1, 2))
        k = torch.cat(keys, 2).repeat_interleave(nh // nkv, 1)
        v = torch.cat(values, 2).repeat_interleave(nh // nkv, 1)
        allowed = torch.cat([causal] + [diagonal] * j, -1)[:, None]
        scores = (q @ k.transpose(-1, -2) * hd ** -0.5).masked_fill(~allowed, float("-inf"))
        a = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(r, t, nh * hd)
        h = hidden + a @ att.o_proj.weight.t()
        y = norm(layer.post_attention_layernorm, h)
        hidden = h + (torch.nn.functional.silu(y @ mlp.gate_proj.weight.t()) * (y @ mlp.up_proj.weight.t())) @ mlp.down_proj.weight.t()
        logp = torch.log_softmax(norm(model.norm, hidden) @ model.lm_head.weight.t(), -1)
        loss, count, hits, total = 0.0, 0, 0, 0
        for b in range(r):
            for s in range(t - shift - 1):
                a_, n_ = s + shift, s + shift + 1  # the target's distribution at t+1+j predicts token t+2+j
                if not (doc_ids[b, n_] == doc_ids[b, s] and doc_ids[b, s] >= 0 and loss_mask[b, n_]):
                    continue
                total += 1
                if not model.t2d[target_argmax[b, a_]]:
                    continue
                count += 1
                loss = loss - (target_p[b, a_] * logp[b, s]).sum()
                hits += int(model.draft_to_target(logp[b, s].argmax()) == target_argmax[b, a_])
        out.append((loss, count, hits, total))
    return out


def random_qkv(r: int, t: int, steps: int):
    """Queries (4 heads) and per-step keys and values (2 KV heads) of head size 16, from the global RNG."""
    q = torch.randn(r, 4, t, 16)
    ks = [torch.randn(r, 2, t, 16) for _ in range(steps)]
    vs = [torch.randn(r, 2, t, 16) for _ in range(steps)]
    return q, ks, vs


def drafter_with_draft_vocab():
    """A drafter over a random 20-token draft vocabulary of the 50-token target (uses the global RNG)."""
    model = drafter_for_target(TARGET, DrafterConfig(draft_vocab_size=20))
    used = torch.sort(torch.randperm(50)[:20]).values
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[used] = True
    model.set_vocab(used - torch.arange(20), t2d)
    return model


def packed_batch(r=2, t=24, vocab=50, hidden=32, seed=3):
    g = torch.Generator().manual_seed(seed)
    doc = torch.full((r, t), -1, dtype=torch.long)
    doc[0, :9], doc[0, 9:20] = 0, 1  # two sequences, then padding
    doc[1, :] = 0
    pos = torch.zeros(r, t, dtype=torch.long)
    for b in range(r):
        for d in doc[b].unique():
            where = doc[b] == d
            pos[b, where] = torch.arange(int(where.sum()))
    mask = doc >= 0
    mask[:, :3] = False  # a prompt: not trained on
    return {"input_ids": torch.randint(0, vocab, (r, t), generator=g), "loss_mask": mask, "doc_ids": doc,
            "position_ids": pos, "aux": torch.randn(r, t, 3 * hidden, generator=g),
            "last": torch.randn(r, t, hidden, generator=g)}


@pytest.mark.parametrize("attention", ["eager", "flex"])
def test_ttt_step_gives_the_plain_loss_accuracy_and_gradients(attention):
    """The chunked, recomputing training step trains exactly what the plain definition of TTT says (fp32).

    Flex attention has no backward on CPU: its case checks the forward only (the GPU path's gradients are flex's).
    """
    check_ttt_step_against_plain(attention)


@pytest.mark.skipif(not shutil.which("g++"), reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_elementwise_path_of_gpu_training_gives_the_plain_loss_accuracy_and_gradients(monkeypatch):
    """On a GPU the norms, SiLU, rotary and the loss are compiled (torch.compile); here compiled for the CPU, the
    same graphs must still train exactly what the plain definition says."""
    monkeypatch.setattr(speed, "COMPILE_DEVICES", ("cuda", "cpu"))
    check_ttt_step_against_plain("eager")


def test_keys_and_values_in_one_buffer_per_unroll_give_the_plain_loss_and_gradients():
    """StepSlots writes each step's keys into one buffer behind autograd's back; the gradients must still be exact."""
    check_ttt_step_against_plain("eager", key_slots=True)


def test_flex_attention_over_the_key_slots_matches_the_cat_of_every_step():
    torch.manual_seed(0)
    model = drafter_with_draft_vocab()
    batch = packed_batch()
    outputs = []
    for key_slots in (False, True):
        ttt = TTTModel(model, torch.randn(50, 32, generator=torch.Generator().manual_seed(3)), 3, 5, "flex",
                       torch.float32, key_slots=key_slots).eval()
        with torch.no_grad():
            outputs.append(ttt(**batch))
    for a, b in zip(*outputs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def check_ttt_step_against_plain(attention: str, key_slots: bool = False) -> None:
    torch.manual_seed(0)
    model = drafter_with_draft_vocab()
    head, steps, batch = torch.randn(50, 32), 3, packed_batch()
    weights = torch.tensor([0.8 ** j for j in range(steps)])

    ttt = TTTModel(model, head, steps, 5, attention, torch.float32, key_slots=key_slots).train()
    with torch.set_grad_enabled(attention == "eager"):
        loss_sum, count, hit, total = ttt(**batch)
        plain = plain_ttt_step(model, head, steps, **batch)
    assert count.tolist() == [float(c) for _, c, _, _ in plain] and min(count.tolist()) > 0
    assert total.tolist() == [float(n) for _, _, _, n in plain]
    assert hit.tolist() == [float(h) for _, _, h, _ in plain]
    assert total.tolist() != count.tolist()  # some targets lie outside the draft vocabulary and are skipped
    torch.testing.assert_close(loss_sum, torch.stack([l for l, _, _, _ in plain]), rtol=1e-5, atol=1e-5)
    if attention == "eager":
        params = [p for p in model.parameters() if p.requires_grad]
        ours = torch.autograd.grad((weights * loss_sum / count).sum(), params)
        reference = torch.autograd.grad(sum(w * l / c for w, (l, c, _, _) in zip(weights, plain)), params)
        for p, g, want in zip(params, ours, reference):
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)


def test_flex_attention_block_mask_spans_several_blocks_with_packed_sequences_and_padding():
    torch.manual_seed(0)
    r, t = 2, 300  # three query blocks of 128, the last one short; each step's keys start mid-block
    q, ks, vs = random_qkv(r, t, 3)
    doc = torch.full((r, t), -1, dtype=torch.long)
    doc[0, :100], doc[0, 100:290], doc[1, :260] = 0, 1, 0
    torch.testing.assert_close(ttt_attention_flex(q, ks, vs, doc), ttt_attention_eager(q, ks, vs, doc),
                               atol=1e-4, rtol=1e-4)


def test_rows_mostly_padding_cost_no_attention_between_padding_blocks():
    """Training pads batches to one length (compiled flex attention recompiles per shape): padding must stay cheap."""
    from draftline.drafter.ttt import ttt_block_masks

    torch.manual_seed(0)
    r, t = 2, 512  # four blocks of 128; row 1 holds 100 real tokens, then three blocks of padding only
    q, ks, vs = random_qkv(r, t, 3)
    doc = torch.full((r, t), -1, dtype=torch.long)
    doc[0, :300], doc[0, 300:450], doc[1, :100] = 0, 1, 0
    torch.testing.assert_close(ttt_attention_flex(q, ks, vs, doc), ttt_attention_eager(q, ks, vs, doc),
                               atol=1e-4, rtol=1e-4)
    mask = ttt_block_masks(doc, 1)[0]
    step0 = mask.kv_num_blocks[1, 0] + mask.full_kv_num_blocks[1, 0]
    assert step0.tolist() == [1, 1, 1, 1]  # each block of row 1 meets only its own diagonal block


def test_block_masks_carry_the_same_backward_block_lists_as_flex_attention_derives():
    """The backward of flex attention walks query blocks per key block; ours come from the dense masks, torch's
    from_kv_blocks derives them from the key-block lists. They must agree exactly, or gradients go wrong on a GPU."""
    from torch.nn.attention.flex_attention import BlockMask

    from draftline.drafter.ttt import ttt_block_masks

    doc = torch.full((2, 300), -1, dtype=torch.long)
    doc[0, :100], doc[0, 100:290], doc[1, :260] = 0, 1, 0
    for mask in ttt_block_masks(doc, 3):
        derived = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                                           mask.full_kv_indices, BLOCK_SIZE=mask.BLOCK_SIZE, seq_lengths=mask.seq_lengths)
        for name in ("q_num_blocks", "full_q_num_blocks"):
            assert torch.equal(getattr(mask, name), getattr(derived, name)), name
        for num, name in (("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
            counts = getattr(mask, num)  # past each row's count the order of absent blocks does not matter
            ours, theirs = getattr(mask, name), getattr(derived, name)
            used = torch.arange(ours.shape[-1]) < counts[..., None]
            assert torch.equal(ours[used], theirs[used]), name
        assert int(mask.q_num_blocks.sum()) > 0
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                     "q_indices", "full_q_num_blocks", "full_q_indices"):  # the kernels read them as contiguous
            assert getattr(mask, name).is_contiguous(), name


def test_padding_a_batch_to_a_fixed_length_changes_no_loss_count_or_hit():
    torch.manual_seed(0)
    model = drafter_with_draft_vocab()
    ttt = TTTModel(model, torch.randn(50, 32), 3, 5, "eager", torch.float32).eval()
    batch = packed_batch()
    extra = 40
    padded = {k: torch.cat([v, v.new_zeros((v.shape[0], extra) + v.shape[2:])], dim=1) for k, v in batch.items()}
    padded["doc_ids"][:, -extra:] = -1
    with torch.no_grad():
        short, long = ttt(**batch), ttt(**padded)
    for a, b in zip(short, long):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_collate_pads_every_batch_to_the_fixed_length_with_padding_doc_ids():
    from draftline.drafter.data import Sequence, collate, pack_rows

    def seq(n):
        return Sequence(torch.arange(n), torch.ones(n, dtype=torch.bool), torch.randn(n, 6), torch.randn(n, 2))

    shapes = set()
    for lengths in ([5, 7, 3], [20], [1, 1]):
        batch = collate(pack_rows([seq(n) for n in lengths], 24), 6, 2, length=24)
        shapes.add(tuple(batch["aux"].shape))
        real = sum(lengths)
        assert int((batch["doc_ids"] >= 0).sum()) == int(batch["loss_mask"].sum()) == real
    assert shapes == {(1, 24, 6)}


@pytest.mark.parametrize("t", [300, 256])  # keys of a step starting mid-block, and on a block boundary
def test_flex_attention_with_blank_keys_of_later_steps_equals_the_eager_attention(t):
    torch.manual_seed(0)
    q, ks, vs = random_qkv(2, t, 2)
    doc = torch.full((2, t), -1, dtype=torch.long)
    doc[0, :100], doc[0, 100:t - 10], doc[1, :t // 2] = 0, 1, 0
    torch.testing.assert_close(ttt_attention_flex(q, ks, vs, doc, total_steps=5), ttt_attention_eager(q, ks, vs, doc),
                               atol=1e-4, rtol=1e-4)


def test_every_step_of_an_unroll_calls_flex_attention_with_one_shape(monkeypatch):
    """Compiled flex attention recompiles for each new shape, and stops compiling after 8 (seen on an H200 with k = 3:
    key lengths 512, 1024, 1536, times batch sizes, times validation)."""
    import draftline.drafter.ttt as ttt_module
    from torch.nn.attention.flex_attention import flex_attention

    shapes = []

    def recording_flex(q, k, v, **kw):
        shapes.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return flex_attention(q, k, v, **kw)

    monkeypatch.setattr(ttt_module, "_FLEX", recording_flex)
    model = drafter_for_target(TARGET, DrafterConfig(draft_vocab_size=20))
    ttt = TTTModel(model, torch.randn(50, 32), 4, 5, "flex", torch.float32).eval()
    batch = packed_batch()
    with torch.no_grad():
        list(ttt.unroll(batch["input_ids"], batch["doc_ids"], batch["position_ids"], batch["aux"]))
    assert len(shapes) == 4 and len(set(shapes)) == 1
    assert shapes[0][1][2] == 4 * batch["input_ids"].shape[1]  # keys of all four steps, the later ones blank


def test_bf16_training_holds_the_frozen_embeddings_in_bf16_with_the_values_it_reads():
    """Training in bf16 keeps the target's frozen embedding table in bf16 (half the memory of fp32): the values are
    those the fp32 table gave after the cast every lookup made, and the trained parameters stay fp32."""
    m = drafter()
    before = m.embed_tokens.weight.detach().clone()
    TTTModel(m, torch.randn(TARGET["vocab_size"], TARGET["hidden_size"]), 2, 16, "eager", torch.bfloat16)
    assert m.embed_tokens.weight.dtype == torch.bfloat16 and not m.embed_tokens.weight.requires_grad
    assert torch.equal(m.embed_tokens.weight, before.to(torch.bfloat16))
    assert {p.dtype for p in m.parameters() if p.requires_grad} == {torch.float32}
    fp32 = drafter()
    TTTModel(fp32, torch.randn(TARGET["vocab_size"], TARGET["hidden_size"]), 2, 16, "eager", torch.float32)
    assert fp32.embed_tokens.weight.dtype == torch.float32
