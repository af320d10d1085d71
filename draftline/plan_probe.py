"""How fast this machine's cores are now and how much of them other work leaves: fixed TTT training steps of the
demo drafter's shape on random data, one thread in each of a process per core and then a thread per core in one
process, timed by the wall clock and by the CPU time they got.

The planner's CPU rates were measured on one idle 2-core machine; the same kind of machine ran the same stages up to
1.6x apart, and 3x slower while other work shared its cores. Tokens per CPU-second give the cores' speed whatever the
load; the CPU time each process gets per wall second is the share of the cores an engine's threads get beside the
other work; torch's threads in one process lose more than that share when they share the cores, as they wait for each
other. `draftline plan --calibrate` scales the CPU rates by these (draftline.plan_model.calibration).
"""
from __future__ import annotations

import time

import torch

# The demo drafter's shape (configs/demo.yaml on the demo Llama) and 3 TTT steps; a step of two rows of 256 tokens in
# one thread, and of the demo trainer's own batch (2,048 tokens in rows of 512) with a thread per core: how much
# torch's threads lose beside other work depends on how much work lies between their waits for each other.
SHAPE = {"hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2, "vocab": 4096, "draft_vocab": 2048}
ONE_THREAD_BATCH, THREADED_BATCH, TTT_STEPS = (2, 256), (4, 512), 3
WARMUP_S = 1.0


def probe(seconds: float = 3.0, processes: int | None = None) -> dict:
    """Two readings of the probe's TTT step (forward, backward, AdamW), each over about `seconds` of whole steps in
    fresh processes: one torch thread in each of a process per core at once (the median tokens per CPU-second and
    the mean CPU share, CPU time over wall time, of a process), then one process with torch's own thread per core, as
    the trainer runs (its tokens per wall second: what sharing the cores costs torch's threads, which wait for each
    other)."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    n = processes or len(os.sched_getaffinity(0))
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        readings = list(pool.map(_probe_in_threads, [seconds] * n, [1] * n))
        threaded = pool.submit(_probe_in_threads, seconds, n).result()
    rates = sorted(r["tokens_per_cpu_s"] for r in readings)
    return {"tokens_per_cpu_s": rates[len(rates) // 2], "cpu_share": sum(r["cpu_share"] for r in readings) / n,
            "threaded_tokens_per_s": threaded["tokens_per_s"], "processes": readings, "threaded": threaded}


def _probe_in_threads(seconds: float, threads: int) -> dict:
    torch.set_num_threads(threads)
    return _timed_steps(seconds, *(ONE_THREAD_BATCH if threads == 1 else THREADED_BATCH))


def _timed_steps(seconds: float, rows: int, seq: int) -> dict:
    from draftline.drafter.model import Eagle3Config, Eagle3Drafter
    from draftline.drafter.ttt import TTTModel, loss_plan

    g = torch.Generator().manual_seed(0)
    h, vocab, draft = SHAPE["hidden"], SHAPE["vocab"], SHAPE["draft_vocab"]
    cfg = Eagle3Config(hidden_size=h, intermediate_size=SHAPE["intermediate"], num_attention_heads=SHAPE["heads"],
                       num_key_value_heads=SHAPE["kv_heads"], head_dim=h // SHAPE["heads"], vocab_size=vocab,
                       draft_vocab_size=draft, target_hidden_size=h, aux_layer_ids=[1, 4, 6],
                       max_position_embeddings=seq)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    used = torch.arange(0, vocab, vocab // draft)  # every other token id: a fixed draft vocabulary
    in_draft = torch.zeros(vocab, dtype=torch.bool)
    in_draft[used] = True
    drafter.set_vocab(used - torch.arange(draft), in_draft)
    lm_head = torch.randn(vocab, h, generator=g) * h ** -0.5
    ttt = TTTModel(drafter, lm_head, TTT_STEPS, 1024, "eager", torch.float32)
    batch = {"input_ids": torch.randint(0, vocab, (rows, seq), generator=g),
             "loss_mask": torch.ones(rows, seq, dtype=torch.bool),
             "doc_ids": torch.zeros(rows, seq, dtype=torch.long),
             "position_ids": torch.arange(seq).expand(rows, seq).contiguous(),
             "aux": torch.randn(rows, seq, 3 * h, generator=g),
             "last": torch.randn(rows, seq, h, generator=g)}
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    plan = loss_plan(batch["loss_mask"], batch["doc_ids"], TTT_STEPS)

    def step() -> None:
        loss_sum, count, _, _ = ttt(**batch, plan=plan)
        loss_sum.sum().div(count.clamp(min=1).sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # Warm up for a second: the first steps' allocations keep the kernel busy outside this process's CPU time.
    warm = time.perf_counter()
    while time.perf_counter() - warm < WARMUP_S:
        step()
    start, cpu_start, steps = time.perf_counter(), time.process_time(), 0
    while (elapsed := time.perf_counter() - start) < seconds or steps < 2:
        step()
        steps += 1
    cpu = time.process_time() - cpu_start
    tokens = rows * seq * steps
    return {"tokens_per_s": tokens / elapsed, "tokens_per_cpu_s": tokens / cpu, "cpu_share": min(1.0, cpu / elapsed),
            "wall_s": elapsed, "cpu_s": cpu}
