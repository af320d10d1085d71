"""EAGLE-3 chain speculative decoding (draft, verify, accept) in torch, and plain decoding as its speed baseline.

Chain drafting only: one candidate per draft position (EAGLE "top-k 1"); tree drafting is NOT implemented.
Acceptance is counted in vLLM's definitions (draftline.acceptance), as the verifier decided it, before output is cut
at EOS or max_new_tokens (as vLLM does).

Greedy verification (temperature 0) reproduces plain greedy decoding of the target token for token (tested exact in
float32; in bf16 the k+1-token verify forward may round differently from a 1-token step and flip a near tie); sampling uses
the standard rejection rule (accept a draft token with probability min(1, p/q), else sample norm(max(0, p - q))),
so its output is distributed exactly as the target's own samples.

Batches hold rows that advance by different amounts (draftline.ragged_batch), so rows never wait for each other.
Finished rows keep computing until the whole batch is done (no compaction): use batch 1, the default, for timing.

Two implementations of the same algorithm, chosen by `fast` on SpeculativeDecoder and plain_decode (None: fast on
CUDA, eager elsewhere); Generation.mode says which ran:
  * "eager": the reference below, over transformers' DynamicCache (grown by concatenation, cropped after
    rejections). Simple and exact, but host-bound on a GPU (Python work per forward, several syncs per step).
  * "cuda-graphs" / "static-eager": draftline.decode_static's preallocated caches with fixed-shape forwards,
    replayed as CUDA graphs on CUDA ("static-eager": the same code without capture, on CPU or when capture fails),
    with one host sync per speculative iteration; at temperature 0 the drafting, verification and pointer updates
    run inside the graphs too (three replays per iteration, one per plain step), and `sync_every` iterations or
    plain steps run back to back per host sync (8 on CUDA by default), their reports gathered in a device ring and
    read at once; steps that ran after every row finished are discarded. Same tokens and acceptance as the
    eager path in float32 (tested); in bf16 the longer masked key range may round differently and flip a near tie.
    Plain decoding uses the same machinery, so speedups compare like with like.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.nn.functional as F

from draftline.acceptance import AcceptanceStats, Generation
from draftline.errors import ConfigError
from draftline.ragged_batch import (
    RaggedDrafter, RaggedTarget, RowOutputs, left_pad, pick_token, sample_token, sync_device,
)


def _use_fast_path(fast: bool | None, device) -> bool:
    """None means on for CUDA, where the eager path is host-bound; off elsewhere (the exact reference)."""
    return torch.device(device).type == "cuda" if fast is None else bool(fast)


def _static_mode(*captured: bool) -> str:
    """The fast path's mode from whether each part (target side, drafter side) replayed as graphs."""
    return "cuda-graphs" if all(captured) else "cuda-graphs-partial" if any(captured) else "static-eager"


def resolve_sync_every(sync_every: int | None, device) -> int:
    """Greedy fast-path steps run back to back per host sync; None = 8 on CUDA (hides launch and sync latency), 1
    elsewhere (on CPU there is no idle device to keep busy)."""
    if sync_every is None:
        return 8 if torch.device(device).type == "cuda" else 1
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ConfigError(f"sync_every={sync_every!r} must be a whole number of steps, at least 1")
    return sync_every


def _window(rows: "RowOutputs", sync_every: int, free_slots: int, slots_per_step: int) -> int:
    """Steps to run before the next host sync: at most sync_every, no more than the slowest active row can still
    need (every step emits at least one token per active row), and never more than the caches hold."""
    still_needed = max(rows.max_new_tokens - len(rows.tokens[r]) for r in range(len(rows.tokens)) if rows.active[r])
    fits = free_slots // slots_per_step
    if fits < 1:  # slots_needed budgets for every window; this guards the index_copy that would kill a CUDA context
        raise RuntimeError(f"static caches full ({free_slots} free slots, {slots_per_step} per step) with rows still "
                           "active: slots_needed is short")
    return min(sync_every, still_needed, fits)


def _check_common(max_new_tokens: int, temperature: float) -> None:
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be at least 1")
    if not temperature >= 0.0:
        raise ConfigError(f"temperature={temperature} must be 0 (greedy) or positive")


# ---------------------------------------------------------------- plain decoding

@torch.no_grad()
def plain_decode(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 eos_token_ids: Sequence[int] = (), pad_token_id: int = 0, seed: int = 0,
                 fast: bool | None = None, sync_every: int | None = None) -> Generation:
    """Decode the target alone, one token per forward, with the same batching and masking as the speculative path.

    fast: the static-cache path (CUDA graphs on CUDA) instead of the eager one; None = on for CUDA. Its buffers and
    graphs are kept on the model object and reused while batch size and capacity fit.
    sync_every: greedy fast path only, steps run back to back per host sync (resolve_sync_every; 1 = a sync per step).
    """
    _check_common(max_new_tokens, temperature)
    device = next(model.parameters()).device
    sync_every = resolve_sync_every(sync_every, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    if _use_fast_path(fast, device):
        return _plain_decode_static(model, prompts, max_new_tokens, temperature, eos_token_ids, pad_token_id,
                                    generator, use_graphs=torch.device(device).type == "cuda", sync_every=sync_every)
    sync_device(device)
    start = time.perf_counter()
    target = RaggedTarget(model, None)
    ids, valid, positions = left_pad(prompts, pad_token_id, device)
    rows = RowOutputs(len(prompts), max_new_tokens, eos_token_ids)
    logits, _ = target.forward(ids, positions, valid, last_only=True)
    nxt = pick_token(logits[:, -1], temperature, generator)
    lengths = valid.sum(1)
    for row, t in enumerate(nxt.tolist()):
        rows.emit(row, [t])
    ones = torch.ones(len(prompts), 1, dtype=torch.bool, device=device)
    while rows.any_active:
        logits, _ = target.forward(nxt[:, None], lengths[:, None], ones)
        lengths = lengths + 1
        nxt = pick_token(logits[:, -1], temperature, generator)
        for row, t in enumerate(nxt.tolist()):
            rows.emit(row, [t])
    sync_device(device)
    return Generation(tokens=rows.tokens, seconds=time.perf_counter() - start, target_forwards=target.forwards)


def _plain_static_target(model, batch: int, slots: int, use_graphs: bool):
    """The StaticTarget plain decoding reuses (kept on the model), rebuilt when batch, capacity or mode change."""
    from draftline.decode_static import StaticTarget, round_slots

    have = getattr(model, "_draftline_plain_static", None)
    if have is None or have.batch != batch or have.num_slots < slots or have.use_graphs != use_graphs:
        model._draftline_plain_static = None  # free the old buffers and graphs before allocating new ones
        have = StaticTarget(model, None, batch, round_slots(slots, 128 if batch == 1 else 16), lengths=(1,),
                            use_graphs=use_graphs)
        have.use_graphs = use_graphs
        model._draftline_plain_static = have
    return have


def _plain_decode_static(model, prompts, max_new_tokens, temperature, eos_token_ids, pad_token_id, generator,
                         use_graphs: bool, sync_every: int = 1) -> Generation:
    from draftline.decode_static import slots_needed

    device = next(model.parameters()).device
    ids, valid, positions = left_pad(prompts, pad_token_id, device)
    sync_device(device)
    setup_start = time.perf_counter()
    greedy = temperature == 0.0
    target = _plain_static_target(
        model, len(prompts), slots_needed(ids.shape[1], max_new_tokens, 0, len(prompts), sync_every if greedy else 1),
        use_graphs)
    if greedy and getattr(target, "greedy_step", None) is None:
        from draftline.decode_static import GreedyPlainStep

        target.greedy_step = GreedyPlainStep(target, use_graphs)
    if greedy:
        ring = target.greedy_step.report_ring(sync_every)  # allocated here, outside the timed decoding
    target.reset()
    sync_device(device)
    start = time.perf_counter()
    rows = RowOutputs(len(prompts), max_new_tokens, eos_token_ids)
    logits, _ = target.prefill(ids, positions, valid)
    nxt = pick_token(logits[:, -1], temperature, generator)
    for row, t in enumerate(nxt.tolist()):
        rows.emit(row, [t])
    lengths = valid.sum(1)
    discarded = 0
    if greedy:
        # Greedy: per step one call (forward, argmax, advance; a graph on CUDA) whose token is copied into the ring
        # on the device; one sync per window of up to sync_every steps reads them all, then the steps' bookkeeping
        # runs in order. Steps after every row finished are discarded (their slots were budgeted by slots_needed).
        step = target.greedy_step
        slot = ids.shape[1]  # host copy of step.slot, exact: it advances by one per step
        step.start(nxt, lengths, slot)
        while rows.any_active:
            n = _window(rows, sync_every, target.num_slots - slot, 1)
            for j in range(n):
                ring[j].copy_(step())
            for tokens in ring[:n].tolist():
                slot += 1
                if not rows.any_active:
                    discarded += 1
                    continue
                for row, t in enumerate(tokens):
                    rows.emit(row, [t])
        captured = step.graphs
    else:
        slot = torch.full((1,), ids.shape[1], dtype=torch.long, device=device)
        while rows.any_active:
            logits, _ = target(nxt[:, None], lengths[:, None], slot)
            lengths, slot = lengths + 1, slot + 1
            nxt = pick_token(logits[:, -1], temperature, generator)
            for row, t in enumerate(nxt.tolist()):
                rows.emit(row, [t])
        captured = target.graphs
    sync_device(device)
    return Generation(tokens=rows.tokens, seconds=time.perf_counter() - start,
                      target_forwards=target.forwards - discarded, mode=_static_mode(captured),
                      setup_seconds=start - setup_start, discarded_target_forwards=discarded)


# ---------------------------------------------------------------- speculative decoding

# How draft tokens are chosen when temperature > 0. "greedy" (vLLM's default draft_sample_method) proposes the drafter's
# argmax and verifies it as a point mass; "probabilistic" samples q = softmax(draft logits / T) (the textbook rule).
# Both leave the output distributed exactly as the target's; they differ in acceptance, so parity must match the engine.
DRAFT_SAMPLING = ("greedy", "probabilistic")


class SpeculativeDecoder:
    """EAGLE-3 chain speculative decoding of a transformers target with an Eagle3Drafter; k drafts per step.

    The drafter pairs the target's aux hidden state at position t (fc of the inputs of the layers named by its
    aux_layer_ids, vLLM convention) with the token at t+1 and predicts the token at t+2, at RoPE position t.

    fast: run draftline.decode_static's static caches (CUDA graphs on CUDA) instead of the eager reference;
    None = on for CUDA. The buffers and graphs are built at the first generate and reused while the batch size
    matches and the capacity suffices (rebuilding, e.g. for a longer prompt, costs a capture again). Both paths
    support ragged batches. Host syncs: one per sync_every iterations in the greedy fast path, one per iteration
    when sampling, several per iteration in the eager path.

    sync_every: at temperature 0 on the fast path, iterations run back to back per host sync (resolve_sync_every:
    None = 8 on CUDA, 1 elsewhere). Output, acceptance and forward counts are those of sync_every=1; iterations run
    past the end of every row are discarded and reported as Generation.discarded_target_forwards.
    """

    def __init__(self, target_model, drafter, k: int, *, temperature: float = 0.0,
                 eos_token_ids: Sequence[int] = (), pad_token_id: int = 0, seed: int = 0,
                 draft_sampling: str = "greedy", fast: bool | None = None, sync_every: int | None = None,
                 aux_layer_ids: Sequence[int] | None = None):
        """aux_layer_ids: feed the drafter these target layers instead of its own (vLLM convention), to measure what
        wrong ids cost it."""
        if k < 1:
            raise ConfigError(f"k={k} draft tokens per step must be at least 1")
        if draft_sampling not in DRAFT_SAMPLING:
            raise ConfigError(f"draft_sampling={draft_sampling!r} is unknown; use one of {list(DRAFT_SAMPLING)}")
        if not temperature >= 0.0:
            raise ConfigError(f"temperature={temperature} must be 0 (greedy) or positive")
        cfg = drafter.config
        target_cfg = target_model.config.get_text_config() if hasattr(target_model.config, "get_text_config") else target_model.config
        if cfg.vocab_size != target_cfg.vocab_size or cfg.target_hidden_size != target_cfg.hidden_size:
            raise ConfigError(
                f"the drafter was built for a target with vocab_size={cfg.vocab_size}, hidden_size="
                f"{cfg.target_hidden_size}, but this target has {target_cfg.vocab_size} and {target_cfg.hidden_size}; "
                "use a drafter trained for this target"
            )
        self.model = target_model
        self.drafter = drafter
        self.k = int(k)
        self.temperature = float(temperature)
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        self.seed = seed
        self.draft_sampling = draft_sampling
        self.aux_layer_ids = list(cfg.aux_layer_ids if aux_layer_ids is None else aux_layer_ids)
        self.fast = fast
        self.sync_every = resolve_sync_every(sync_every, next(target_model.parameters()).device)
        self.static = None  # (StaticTarget, StaticDrafter) of the fast path, built at first use
        self.static_greedy = None  # GreedySpecIteration over self.static, built at the first greedy use

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, profile: bool = False,
                 seed: int | None = None) -> Generation:
        """Decode every prompt; profile=True also times target and drafter forwards (adds device syncs)."""
        _check_common(max_new_tokens, self.temperature)
        device = next(self.model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(self.seed if seed is None else seed)
        timer = _Timer(device, profile)
        if _use_fast_path(self.fast, device):
            return self._generate_static(prompts, max_new_tokens, generator, timer)
        sync_device(device)
        start = time.perf_counter()

        k, temp, batch = self.k, self.temperature, len(prompts)
        target, drafter = RaggedTarget(self.model, self.aux_layer_ids), RaggedDrafter(self.drafter)
        stats = AcceptanceStats(k=k)
        rows = RowOutputs(batch, max_new_tokens, self.eos_token_ids)
        hidden_dtype = self.drafter.fc.weight.dtype
        arange_b = torch.arange(batch, device=device)

        # Prefill: the target reads the prompt and picks the first token; the drafter reads the same slots,
        # each target hidden state paired with the following token (the last one with the first new token).
        ids, valid, positions = left_pad(prompts, self.pad_token_id, device)
        with timer.target():
            logits, aux = target.forward(ids, positions, valid, last_only=True)
        first = pick_token(logits[:, -1], temp, generator)
        for row, t in enumerate(first.tolist()):
            rows.emit(row, [t])
        lengths = valid.sum(1)  # logical position of each row's pending token
        pending = first
        next_ids = torch.cat([ids[:, 1:], first[:, None]], dim=1)
        with timer.drafter():
            d_logits, d_hidden = drafter.forward(next_ids, self.drafter.fc(aux.to(hidden_dtype)), positions, valid)
        last_logits, last_hidden = d_logits[:, -1], d_hidden[:, -1:]

        ones = torch.ones(batch, 1, dtype=torch.bool, device=device)
        while rows.any_active:
            active = rows.active[:]
            # Draft k tokens; draft steps feed the drafter's own hidden state and are discarded afterwards.
            real_slots = drafter.slots
            drafts, q_probs = [], []
            step_logits, step_hidden = last_logits, last_hidden
            for j in range(k):
                drafts.append(self._draft_token(step_logits, generator, q_probs))
                if j + 1 < k:
                    with timer.drafter():
                        step_logits, step_hidden = drafter.forward(
                            drafts[-1][:, None], step_hidden, (lengths + j)[:, None], ones)
                    step_logits = step_logits[:, -1]
            drafter.keep(real_slots)
            drafts_t = torch.stack(drafts, dim=1)  # [B, k]

            # Verify: the target scores [pending, d_1..d_k] in one forward.
            verify_ids = torch.cat([pending[:, None], drafts_t], dim=1)
            verify_pos = lengths[:, None] + torch.arange(k + 1, device=device)
            with timer.target():
                logits, aux = target.forward(verify_ids, verify_pos, torch.ones_like(verify_ids, dtype=torch.bool))
            accepted, bonus = self._verify(logits, drafts_t, q_probs, generator)

            acc_list, bonus_list, drafts_list = accepted.tolist(), bonus.tolist(), drafts_t.tolist()
            for row in range(batch):
                if active[row]:
                    stats.record(acc_list[row])
                    rows.emit(row, drafts_list[row][:acc_list[row]] + [bonus_list[row]])
            if not rows.any_active:
                break

            # Keep the verified slots up to the longest accepted run; shorter rows leave masked holes.
            width = max(acc_list) + 1
            slot_kept = torch.arange(width, device=device)[None, :] <= accepted[:, None]
            target.keep(target.slots - (k + 1) + width, slot_kept)

            # The drafter reads the verified slots with their real hidden states, paired with the next token.
            next_ids = torch.cat([drafts_t, bonus[:, None]], dim=1)[:, :width].clone()
            next_ids[arange_b, accepted] = bonus
            with timer.drafter():
                d_logits, d_hidden = drafter.forward(
                    next_ids, self.drafter.fc(aux[:, :width].to(hidden_dtype)), verify_pos[:, :width], slot_kept)
            last_logits = d_logits[arange_b, accepted]
            last_hidden = d_hidden[arange_b, accepted][:, None]
            lengths = lengths + accepted + 1
            pending = bonus

        sync_device(device)
        return Generation(tokens=rows.tokens, seconds=time.perf_counter() - start, target_forwards=target.forwards,
                          stats=stats, target_seconds=timer.target_s, drafter_seconds=timer.drafter_s,
                          drafter_forwards=drafter.forwards)

    def _static_runners(self, batch: int, slots: int):
        from draftline.decode_static import StaticDrafter, StaticTarget, round_slots

        device = next(self.model.parameters()).device
        use_graphs = torch.device(device).type == "cuda"
        have = self.static
        if have is None or have[0].batch != batch or have[0].num_slots < slots:
            self.static = self.static_greedy = None  # free the old buffers and graphs first
            slots = round_slots(slots, 128 if batch == 1 else 16)
            self.static = (StaticTarget(self.model, self.aux_layer_ids, batch, slots, lengths=(self.k + 1,),
                                        use_graphs=use_graphs),
                           StaticDrafter(self.drafter, batch, slots, self.k + 1, use_graphs=use_graphs))
        return self.static

    def _greedy_iteration(self, target, drafter):
        """The greedy iteration's calls over these runners (built, and on CUDA captured, once per pair)."""
        from draftline.decode_static import GreedySpecIteration

        have = self.static_greedy
        if have is None or have.target is not target or have.drafter is not drafter:
            self.static_greedy = None
            self.static_greedy = GreedySpecIteration(target, drafter, self.k,
                                                     use_graphs=target.device.type == "cuda")
        return self.static_greedy

    def _generate_static(self, prompts, max_new_tokens: int, generator, timer: "_Timer") -> Generation:
        """The eager loop of generate() over static caches: same choices, same acceptance, fixed-shape forwards."""
        from draftline.decode_static import slots_needed

        device = next(self.model.parameters()).device
        k, temp, batch = self.k, self.temperature, len(prompts)
        ids, valid, positions = left_pad(prompts, self.pad_token_id, device)
        sync_device(device)
        setup_start = time.perf_counter()
        sync_every = self.sync_every if temp == 0.0 else 1
        target, drafter = self._static_runners(batch, slots_needed(ids.shape[1], max_new_tokens, k, batch, sync_every))
        greedy = self._greedy_iteration(target, drafter) if temp == 0.0 else None
        if greedy is not None:
            greedy.report_ring(sync_every)  # allocated here, outside the timed decoding
        target.reset()
        drafter.reset()
        sync_device(device)
        start = time.perf_counter()

        stats = AcceptanceStats(k=k)
        rows = RowOutputs(batch, max_new_tokens, self.eos_token_ids)
        arange_b = torch.arange(batch, device=device)
        offsets = torch.arange(k + 1, device=device)

        with timer.target():
            logits, aux = target.prefill(ids, positions, valid)
        first = pick_token(logits[:, -1], temp, generator)
        for row, t in enumerate(first.tolist()):
            rows.emit(row, [t])
        lengths = valid.sum(1)  # logical position of each row's pending token
        pending = first
        next_ids = torch.cat([ids[:, 1:], first[:, None]], dim=1)
        with timer.drafter():
            d_logits, d_hidden = drafter.prefill(next_ids, aux, positions, valid)
        last_logits, last_hidden = d_logits[:, -1], d_hidden[:, -1:]
        if greedy is not None:
            return self._greedy_loop(greedy, ids.shape[1], lengths, pending, last_logits, last_hidden, rows, stats,
                                     timer, start, setup_start)
        base = torch.full((1,), ids.shape[1], dtype=torch.long, device=device)  # first free slot, both caches

        while rows.any_active:
            active = rows.active[:]
            # This iteration's positions and slots, computed once: draft step j and verified token j share them.
            verify_pos = lengths[:, None] + offsets  # [B, k+1] logical (RoPE) positions
            verify_slots = base + offsets  # [k+1] physical slots; draft steps' slots are overwritten below
            drafts, q_probs = [], []
            step_logits, step_hidden = last_logits, last_hidden
            for j in range(k):
                drafts.append(self._draft_token(step_logits, generator, q_probs))
                if j + 1 < k:
                    with timer.drafter():
                        step_logits, step_hidden = drafter.draft(drafts[-1][:, None], step_hidden,
                                                                 verify_pos[:, j:j + 1], verify_slots[j:j + 1])
                    step_logits = step_logits[:, -1]
            drafts_t = torch.stack(drafts, dim=1)  # [B, k]

            verify_ids = torch.cat([pending[:, None], drafts_t], dim=1)
            with timer.target():
                logits, aux = target(verify_ids, verify_pos, base)
            accepted, bonus = self._verify(logits, drafts_t, q_probs, generator)

            # Rejected slots become masked holes; slots past the longest accepted run are overwritten next time.
            slot_kept = offsets[None, :] <= accepted[:, None]
            target.key_valid.index_copy_(1, verify_slots, slot_kept)
            next_ids = torch.cat([drafts_t, bonus[:, None]], dim=1)
            next_ids[arange_b, accepted] = bonus
            with timer.drafter():
                d_logits, d_hidden = drafter.read_verified(next_ids, aux, verify_pos, base, slot_kept)
            last_logits = d_logits[arange_b, accepted]
            last_hidden = d_hidden[arange_b, accepted][:, None]
            base = base + accepted.max() + 1
            lengths = lengths + accepted + 1
            pending = bonus

            # The iteration's one host sync, after all its device work is queued: rows' output, EOS, length.
            report = torch.cat([accepted[:, None], drafts_t, bonus[:, None]], dim=1).tolist()
            for row in range(batch):
                if active[row]:
                    acc = report[row][0]
                    stats.record(acc)
                    rows.emit(row, report[row][1:1 + acc] + [report[row][k + 1]])

        sync_device(device)
        return Generation(tokens=rows.tokens, seconds=time.perf_counter() - start, target_forwards=target.forwards,
                          stats=stats, target_seconds=timer.target_s, drafter_seconds=timer.drafter_s,
                          drafter_forwards=drafter.forwards, mode=_static_mode(target.graphs, drafter.graphs),
                          setup_seconds=start - setup_start)

    def _greedy_loop(self, greedy, base: int, lengths, pending, last_logits, last_hidden, rows: "RowOutputs",
                     stats: AcceptanceStats, timer: "_Timer", start: float, setup_start: float) -> Generation:
        """Temperature 0: the iteration is decode_static.GreedySpecIteration's three calls (graphs on CUDA).

        Eager work per window of up to sync_every iterations: three call replays and one device copy of the report
        [B, k+2] into the ring per iteration, one read of the ring (the window's one host sync), then Python's
        per-row bookkeeping of each iteration in order; drafting, verification and every pointer update run inside
        the calls. Iterations after every row finished are discarded as if never run (not in the stats or the
        forward counts). profile=True times whole windows as target time (the forwards are no longer separate calls).
        """
        k, batch = self.k, len(rows.tokens)
        sync_every = self.sync_every
        ring = greedy.report_ring(sync_every)
        capacity = greedy.target.num_slots  # the drafter's buffers have the same number of slots
        greedy.start(base, lengths, pending, last_logits, last_hidden)
        discarded = 0
        while rows.any_active:
            n = _window(rows, sync_every, capacity - base, k + 1)
            with timer.target():
                for j in range(n):
                    ring[j].copy_(greedy())
                reports = ring[:n].tolist()
            for report in reports:
                # Host copy of greedy.base, exact: the pointer moves past the longest accepted run of any row.
                base += max(r[0] for r in report) + 1
                if not rows.any_active:
                    discarded += 1
                    continue
                active = rows.active[:]
                for row in range(batch):
                    if active[row]:
                        acc = report[row][0]
                        stats.record(acc)
                        rows.emit(row, report[row][1:1 + acc] + [report[row][k + 1]])
        device = greedy.base.device
        sync_device(device)
        return Generation(tokens=rows.tokens, seconds=time.perf_counter() - start,
                          target_forwards=greedy.target.forwards - discarded, stats=stats,
                          target_seconds=timer.target_s, drafter_seconds=timer.drafter_s,
                          drafter_forwards=greedy.drafter.forwards - k * discarded,
                          mode=_static_mode(*greedy.captured), setup_seconds=start - setup_start,
                          discarded_target_forwards=discarded)

    def _draft_token(self, step_logits, generator, q_probs: list) -> torch.Tensor:
        """The next draft token (target ids [B]) from the drafter's logits; when sampling, appends its q to q_probs."""
        draft_ids = self.drafter.draft_token_ids
        if self.temperature == 0.0:
            return draft_ids[step_logits.argmax(-1)]
        vocab = self.drafter.config.vocab_size
        if self.draft_sampling == "greedy":
            # q is then a point mass: accept with probability p(d), else resample p without d.
            idx = step_logits.argmax(-1)
            q_probs.append(F.one_hot(draft_ids[idx], vocab).float())
        else:
            probs = torch.softmax(step_logits / self.temperature, dim=-1)
            idx = sample_token(probs, generator)
            q = torch.zeros(step_logits.shape[0], vocab, device=step_logits.device)
            q_probs.append(q.index_copy_(1, draft_ids, probs))
        return draft_ids[idx]

    def _verify(self, logits, drafts, q_probs, generator):
        """(accepted [B], next token [B]) from target logits [B, k+1, V] and drafts [B, k]."""
        k = self.k
        if self.temperature == 0.0:
            best = logits.argmax(-1)  # [B, k+1]
            accepted = (best[:, :k] == drafts).long().cumprod(1).sum(1)
            return accepted, best.gather(1, accepted[:, None]).squeeze(1)
        p = torch.softmax(logits / self.temperature, dim=-1)  # [B, k+1, V]
        q = torch.stack(q_probs, dim=1)  # [B, k, V]
        p_d = p[:, :k].gather(2, drafts[..., None]).squeeze(-1)
        q_d = q.gather(2, drafts[..., None]).squeeze(-1)
        u = torch.rand(drafts.shape, generator=generator, device=drafts.device)
        ok = u * q_d < p_d  # u < p/q without dividing; q_d > 0 because the draft was sampled from q
        accepted = ok.long().cumprod(1).sum(1)
        rows = torch.arange(drafts.shape[0], device=drafts.device)
        p_at = p[rows, accepted]  # [B, V]
        q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # all accepted: the residual is p itself
        residual = (p_at - q_pad[rows, accepted]).clamp_(min=0.0)
        mass = residual.sum(-1, keepdim=True)
        # A rejection implies p(d) < q(d), hence mass > 0; the fallback only guards float underflow.
        dist = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_at)
        return accepted, sample_token(dist, generator)


class _Timer:
    """Sums wall time spent in target and drafter forwards, synchronising the device only when enabled."""

    def __init__(self, device, enabled: bool):
        self.device, self.enabled = device, enabled
        self.target_s = self.drafter_s = 0.0

    def target(self):
        return _Span(self, "target_s")

    def drafter(self):
        return _Span(self, "drafter_s")


class _Span:
    def __init__(self, timer: _Timer, attr: str):
        self.timer, self.attr = timer, attr

    def __enter__(self):
        if self.timer.enabled:
            sync_device(self.timer.device)
            self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.timer.enabled:
            sync_device(self.timer.device)
            setattr(self.timer, self.attr, getattr(self.timer, self.attr) + time.perf_counter() - self.start)

