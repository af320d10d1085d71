"""GPU correctness probe: the TTT step with compiled flex attention (what GPU training runs) against the exact eager
TTT attention, on the same drafter and batch: per-step loss sums, counts and hits, and every parameter's gradient;
with the keys and values in one buffer per unroll (key_slots) and without.

    python3 benchmarks/probes/ttt_gradients.py      # needs a CUDA device; exits 1 when they disagree

CI has no GPU, so flex attention's compiled backward (which reads the block masks' query-block lists) is checked
here. Small sizes: packed sequences, padding, a length that is not a multiple of the 128-token block, k = 3.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from draftline.drafter.model import Eagle3Config, Eagle3Drafter  # noqa: E402
from draftline.drafter.ttt import TTTModel, loss_plan  # noqa: E402


def batch(device, r=2, t=640, h=256, vocab=4096):
    g = torch.Generator().manual_seed(1)
    doc = torch.full((r, t), -1, dtype=torch.long)
    doc[0, :300], doc[0, 300:610], doc[1, :500] = 0, 1, 0
    pos = torch.zeros(r, t, dtype=torch.long)
    pos[0, :300], pos[0, 300:610], pos[1, :500] = torch.arange(300), torch.arange(310), torch.arange(500)
    return {
        "input_ids": torch.randint(0, vocab, (r, t), generator=g).to(device),
        "loss_mask": (doc >= 0).to(device),
        "doc_ids": doc.to(device),
        "position_ids": pos.to(device),
        "aux": torch.randn(r, t, 3 * h, generator=g).to(device),
        "last": torch.randn(r, t, h, generator=g).to(device),
    }


def step(attention: str, device, compute_dtype, key_slots=False, steps=3, h=256, vocab=4096, draft=2048):
    cfg = Eagle3Config(hidden_size=h, intermediate_size=2 * h, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=h // 4, vocab_size=vocab, draft_vocab_size=draft, target_hidden_size=h,
                       aux_layer_ids=[1, 3, 5])
    torch.manual_seed(0)
    model = Eagle3Drafter(cfg)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    used = torch.sort(torch.randperm(vocab)[:draft]).values
    t2d[used] = True
    model.set_vocab(used - torch.arange(draft), t2d)
    model.to(device)
    head = (torch.randn(vocab, h, generator=torch.Generator().manual_seed(2)) * h ** -0.5).to(device)
    ttt = TTTModel(model, head, steps, 256, attention, compute_dtype, key_slots=key_slots).train()
    b = batch(device)
    plan = loss_plan(b["loss_mask"].cpu(), b["doc_ids"].cpu(), steps).to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=compute_dtype == torch.bfloat16)
    with autocast:
        loss_sum, count, hit, total = ttt(**b, plan=plan)
        loss = (loss_sum / count.clamp(min=1)).sum()
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return [x.detach().float() for x in (loss_sum, count, hit, total)], grads


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    failed = False
    for (dtype, tol), key_slots in ((x, y) for y in (False, True) for x in ((torch.float32, 2e-3), (torch.bfloat16, 5e-2))):
        (f_out, f_grads), (e_out, e_grads) = step("flex", device, dtype, key_slots), step("eager", device, dtype)
        print(f"compute dtype {dtype}, key_slots {key_slots}: loss sums flex {f_out[0].tolist()} eager {e_out[0].tolist()}")
        # Counts and totals exactly; hits (top-1 argmax) may flip on near ties between two roundings.
        same_counts = (torch.equal(f_out[1], e_out[1]) and torch.equal(f_out[3], e_out[3])
                       and bool(((f_out[2] - e_out[2]).abs() <= 0.01 * e_out[1]).all()))
        loss_err = float(((f_out[0] - e_out[0]).abs() / e_out[0].abs().clamp(min=1e-6)).max())
        worst = max(((float((f_grads[n] - e_grads[n]).abs().max() / e_grads[n].abs().max().clamp(min=1e-12)), n)
                     for n in e_grads), default=(0.0, "-"))
        finite = all(torch.isfinite(g).all() for g in f_grads.values())
        ok = same_counts and loss_err < tol and worst[0] < tol and finite and set(f_grads) == set(e_grads)
        print(f"  counts and totals identical, hits within 1% {same_counts}; loss rel err {loss_err:.2e}; worst gradient rel err "
              f"{worst[0]:.2e} ({worst[1]}); gradients finite {finite}; tolerance {tol:g}: {'OK' if ok else 'FAILED'}")
        failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
