"""The fast path of the reference decoder: preallocated KV caches, fixed-shape forwards, CUDA graphs on CUDA.

draftline.speculative's eager path grows transformers' DynamicCache by concatenation, crops it after rejections, builds
masks of a new size every step and syncs the host several times per step; on a GPU that host work, not the
arithmetic, sets the step time. Here every forward the decoding loop repeats has a fixed shape, so it can be
captured once as a CUDA graph and replayed:
  * target: T=1 (a plain decoding step) and T=k+1 (a verify step), over a SlotCache of S preallocated slots;
  * drafter: T=1 (a draft step) and T=k+1 (reading the verified slots), over preallocated key/value buffers.
Slots are physical cache positions shared by every row; a device-side pointer (`base`) names the first free slot.
"Cropping" moves the pointer back: the stale slots stay where they are, masked out by the per-slot validity
buffer key_valid [B, S], and are overwritten by the next writes. A batch of rows that accept different numbers of
drafts leaves masked holes, as in the eager path, so ragged batches work unchanged.

What is exact: the computation is the eager path's, over more (masked) key slots. Masked slots get an additive
bias of finfo.min and contribute exact zeros to the softmax, so in float32 the outputs agree with the eager path
up to the attention kernel's summation order (tested token for token on the demo targets). In bf16 a different
kernel split over the longer key range can round differently and flip a near tie, as the eager path's k+1-token
verify already can relative to a 1-token step. Acceptance is counted exactly as in the eager path.

Modes (Generation.mode): "cuda-graphs" (CUDA, every captured forward replays), "static-eager" (the same
fixed-shape code run eagerly: on CPU, or on CUDA after a failed capture, whose error is kept in
StaticTarget.capture_error / StaticDrafter.capture_error), "cuda-graphs-partial" (one of the two captured, the other
failed), and "eager" (draftline.speculative's reference path). Capture fails on models whose forward syncs the host or
has data-dependent shapes (transformers' DeepSeek-V3 MoE routing, for one); decoding then stays right, only slower.

Greedy decoding (temperature 0) also moves the bookkeeping between the forwards into the calls (GreedyPlainStep,
GreedySpecIteration below): a plain step is one call, a speculative iteration three (the whole draft chain, the
verify with greedy acceptance, the drafter's read with the pointer advance), so the host only replays graphs and
reads one small report. Sampling (temperature > 0, either draft_sampling) keeps the eager bookkeeping around the
pure forwards, since its draws come from a torch.Generator that a graph would have to replay in lockstep.

Host syncs: one per `sync_every` greedy speculative iterations or plain steps (draftline.speculative runs that many back
to back, each call's report copied into a device ring buffer, then reads the ring once for EOS and max_new_tokens,
so the GPU never idles waiting for the host between steps); one per iteration or step when sampling. Prefill runs
eagerly (its length varies). Capture and buffer allocation happen at the first call for a
batch size and capacity and are reported apart (Generation.setup_seconds), outside the timed decoding.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from draftline.target import capture_hidden_states

try:  # transformers >= 4.36; the models check the type of past_key_values only loosely, but subclass to be safe
    from transformers.cache_utils import Cache as _CacheBase
except ImportError:  # pragma: no cover - very old transformers
    _CacheBase = object


def slots_needed(prompt_slots: int, max_new_tokens: int, k: int, batch: int, sync_every: int = 1) -> int:
    """Cache slots a run can touch: the prompt, then per iteration up to k+1 slots (k=0: plain decoding).

    With one row the pointer advances by exactly the tokens emitted, so prompt + max_new_tokens + k + 1 suffice. With
    several rows it advances by the longest accepted run of any row (finished rows included), at most k+1 per
    iteration, for at most max_new_tokens - 1 iterations.
    sync_every > 1: up to sync_every - 1 iterations may run past a finished row before the host looks (their output
    is discarded); each writes at most k+1 slots more. draftline.speculative also clamps every window to the capacity
    left, so a write past the buffers (fatal to a CUDA context) cannot happen even if this bound were short.
    """
    past_the_end = (sync_every - 1) * (k + 1)
    if batch == 1:
        return prompt_slots + max_new_tokens + k + 1 + past_the_end
    return prompt_slots + (max_new_tokens - 1) * (k + 1) + k + 1 + past_the_end


def round_slots(slots: int, multiple: int = 128) -> int:
    """Capacity rounded up, so nearby prompt lengths reuse the same buffers and captured graphs (batch 1, the
    latency case, rounds coarsely; large batches finely, since every row attends over every slot)."""
    return -(-slots // multiple) * multiple


class SlotCache(_CacheBase):
    """A transformers Cache of preallocated [B, heads, S, D] buffers per layer, written at `write_slots`.

    transformers' own StaticCache changed how it finds its write position between 5.x releases (cache_position
    in cache_kwargs, then an internal counter); this cache ignores whatever the model passes and writes at the
    device tensor `write_slots` [T] set by its owner before each forward, so it behaves the same on every version
    whose attention layers call `past_key_values.update(key, value, layer_idx, ...)`. Buffers are allocated at a
    layer's first update, in that layer's shapes (DeepSeek-V3's MLA caches latents, Llama keys and values).
    """

    def __init__(self, num_slots: int):
        try:
            super().__init__(layers=[])
        except TypeError:  # Cache() took no arguments before transformers 5
            super().__init__()
        self.num_slots = num_slots
        self.write_slots: torch.Tensor | None = None
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == len(self.buffers):
            b, h, _, d = key_states.shape
            self.buffers.append((
                # zeros, not empty: masked slots are multiplied by 0 in attention, and 0 * NaN would leak.
                torch.zeros(b, h, self.num_slots, d, dtype=key_states.dtype, device=key_states.device),
                torch.zeros(b, value_states.shape[1], self.num_slots, value_states.shape[-1],
                            dtype=value_states.dtype, device=value_states.device)))
        keys, values = self.buffers[layer_idx]
        keys.index_copy_(2, self.write_slots, key_states)
        values.index_copy_(2, self.write_slots, value_states)
        return keys, values

    # The model reads these only without position_ids or a ready 4D mask; both are always given here.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.num_slots, 0

    def get_query_offset(self, *args, **kwargs) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.buffers)

    def __len__(self) -> int:
        return len(self.buffers)


def slot_bias(key_valid: torch.Tensor, query_slots: torch.Tensor, slot_ids: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, T, S] over physical slots: causal, invalid slots masked, each query sees its own slot.

    Same rule as draftline.ragged_batch.attention_bias, with the query slots given instead of implied by the length.
    """
    causal = slot_ids[None, :] <= query_slots[:, None]  # [T, S]
    own = slot_ids[None, :] == query_slots[:, None]
    allowed = (key_valid[:, None, :] & causal[None]) | own[None]  # [B, T, S]
    bias = torch.zeros(allowed.shape[0], 1, *allowed.shape[1:], dtype=dtype, device=key_valid.device)
    return bias.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


class StaticCall:
    """One fixed-shape forward over static input buffers: a CUDA graph replay when captured, else run eagerly.

    Either way the caller copies its inputs into the same buffers and gets the same output tensors back, so the
    CPU tests run the code the GPU replays, capture aside. Outputs are overwritten by the next call.
    """

    def __init__(self, fn: Callable[..., tuple], inputs: dict[str, torch.Tensor]):
        self.fn = fn
        self.inputs = inputs
        self.graph = None
        self.outputs: tuple | None = None

    def capture(self, warmup: int = 2) -> None:
        """Capture on CUDA after warm-up runs on a side stream (allocator and kernel selection settle there)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.fn(**self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.fn(**self.inputs)
        self.graph, self.outputs = graph, outputs

    def __call__(self, **values) -> tuple:
        for name, value in values.items():
            self.inputs[name].copy_(value)
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        return self.fn(**self.inputs)

    def replay(self) -> tuple:
        """Run again on the inputs already in the buffers (for timing)."""
        return self.__call__()


def _capture_all(calls: dict[int, StaticCall]) -> str | None:
    """Capture every call; on any failure drop all graphs (run static-eager) and return the error text."""
    try:
        for call in calls.values():
            call.capture()
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # capture refuses host syncs, CPU tensors, dynamic shapes: fall back, say why
        for call in calls.values():
            call.graph = call.outputs = None
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


class StaticTarget:
    """The target over a SlotCache: eager calls of any length (prefill) and fixed-shape calls of the lengths asked."""

    def __init__(self, model, aux_layer_ids: list[int] | None, batch: int, num_slots: int,
                 lengths: tuple[int, ...], use_graphs: bool):
        self.model = model
        self.aux_layer_ids = aux_layer_ids
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.batch, self.num_slots = batch, num_slots
        self.cache = SlotCache(num_slots)
        self.key_valid = torch.zeros(batch, num_slots, dtype=torch.bool, device=self.device)
        self.slot_ids = torch.arange(num_slots, device=self.device)
        self.forwards = 0
        self.capture_error: str | None = None
        # One eager forward allocates the cache buffers (their shapes come from the model) before any capture.
        self.run(torch.zeros(batch, 1, dtype=torch.long, device=self.device),
                 torch.zeros(batch, 1, dtype=torch.long, device=self.device),
                 torch.zeros(1, dtype=torch.long, device=self.device))
        self.calls = {t: StaticCall(self._fixed, dict(
            input_ids=torch.zeros(batch, t, dtype=torch.long, device=self.device),
            position_ids=torch.zeros(batch, t, dtype=torch.long, device=self.device),
            first_slot=torch.zeros(1, dtype=torch.long, device=self.device))) for t in lengths}
        if use_graphs:
            self.capture_error = _capture_all(self.calls)
        self.reset()

    @property
    def graphs(self) -> bool:
        return all(c.graph is not None for c in self.calls.values())

    def reset(self) -> None:
        self.key_valid.zero_()
        self.forwards = 0

    def run(self, input_ids, position_ids, first_slot, new_valid=None, last_only: bool = False):
        """T new tokens written at slots first_slot + 0..T-1; (logits [B,T,V] float32 (T=1 if last_only), aux or None)."""
        t = input_ids.shape[1]
        write = first_slot + self.slot_ids[:t]
        if new_valid is None:
            self.key_valid.index_fill_(1, write, True)
        else:
            self.key_valid.index_copy_(1, write, new_valid)
        bias = slot_bias(self.key_valid, write, self.slot_ids, self.dtype)
        self.cache.write_slots = write
        kwargs = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=bias,
                      past_key_values=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        if self.aux_layer_ids is None:
            return self.model(**kwargs).logits.float(), None
        captured: dict[str, torch.Tensor] = {}
        with capture_hidden_states(self.model, self.aux_layer_ids, captured.__setitem__):
            out = self.model(**kwargs)
        return out.logits.float(), torch.cat([captured["aux0"], captured["aux1"], captured["aux2"]], dim=-1)

    def _fixed(self, input_ids, position_ids, first_slot):
        return self.run(input_ids, position_ids, first_slot)

    def __call__(self, input_ids, position_ids, first_slot):
        """A fixed-length call (its length must be one of `lengths`): every new slot valid, logits of every token."""
        self.forwards += 1
        return self.calls[input_ids.shape[1]](input_ids=input_ids, position_ids=position_ids, first_slot=first_slot)

    def prefill(self, input_ids, position_ids, valid):
        self.forwards += 1
        return self.run(input_ids, position_ids, torch.zeros(1, dtype=torch.long, device=self.device), valid,
                        last_only=True)


class StaticDrafter:
    """The EAGLE-3 head over preallocated key/value buffers; computes what ragged_batch.RaggedDrafter computes."""

    def __init__(self, net, batch: int, num_slots: int, verify_len: int, use_graphs: bool):
        from draftline.drafter.model import repeat_kv

        cfg = net.config
        self.net = net
        self.repeat_kv = repeat_kv
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.device = net.fc.weight.device
        self.dtype = net.fc.weight.dtype
        shape = (batch, cfg.num_key_value_heads, num_slots)
        self.keys = torch.zeros(*shape, cfg.head_dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(*shape, cfg.value_dim, dtype=self.dtype, device=self.device)
        self.key_valid = torch.zeros(batch, num_slots, dtype=torch.bool, device=self.device)
        self.slot_ids = torch.arange(num_slots, device=self.device)
        self.forwards = 0
        self.capture_error: str | None = None
        zeros = lambda *s, dtype=torch.long: torch.zeros(*s, dtype=dtype, device=self.device)  # noqa: E731
        # T=1: a draft step from the previous step's hidden state; T=k+1: the verified slots from the target's aux.
        self.step = StaticCall(self._draft_step, dict(
            input_ids=zeros(batch, 1), hidden=zeros(batch, 1, cfg.hidden_size, dtype=self.dtype),
            position_ids=zeros(batch, 1), first_slot=zeros(1)))
        self.read = StaticCall(self._read_verified, dict(
            input_ids=zeros(batch, verify_len), aux=zeros(batch, verify_len, 3 * cfg.target_hidden_size, dtype=self.dtype),
            position_ids=zeros(batch, verify_len), first_slot=zeros(1), valid=zeros(batch, verify_len, dtype=torch.bool)))
        if use_graphs:
            self.capture_error = _capture_all({1: self.step, verify_len: self.read})
        self.reset()

    @property
    def graphs(self) -> bool:
        return self.step.graph is not None and self.read.graph is not None

    def reset(self) -> None:
        self.key_valid.zero_()
        self.forwards = 0

    def run(self, input_ids, hidden, position_ids, first_slot, new_valid=None):
        """(logits [B,T,Vd] float32, hidden_out [B,T,H]) for T new slots written at first_slot + 0..T-1."""
        net = self.net
        t = input_ids.shape[1]
        write = first_slot + self.slot_ids[:t]
        embeds = net.embed_tokens(input_ids).to(hidden.dtype)
        q, k, v = net.midlayer.qkv(embeds, hidden, position_ids)
        self.keys.index_copy_(2, write, k)
        self.values.index_copy_(2, write, v)
        if new_valid is None:
            self.key_valid.index_fill_(1, write, True)
        else:
            self.key_valid.index_copy_(1, write, new_valid)
        bias = slot_bias(self.key_valid, write, self.slot_ids, q.dtype)
        attn = F.scaled_dot_product_attention(q, self.repeat_kv(self.keys, self.groups),
                                              self.repeat_kv(self.values, self.groups), attn_mask=bias)
        hidden_out = net.midlayer.finish(hidden, attn)
        return net.lm_head(net.norm(hidden_out)).float(), hidden_out

    def _draft_step(self, input_ids, hidden, position_ids, first_slot):
        return self.run(input_ids, hidden, position_ids, first_slot)

    def _read_verified(self, input_ids, aux, position_ids, first_slot, valid):
        return self.run(input_ids, self.net.fc(aux), position_ids, first_slot, valid)

    def draft(self, input_ids, hidden, position_ids, first_slot):
        self.forwards += 1
        return self.step(input_ids=input_ids, hidden=hidden, position_ids=position_ids, first_slot=first_slot)

    def read_verified(self, input_ids, aux, position_ids, first_slot, valid):
        self.forwards += 1
        return self.read(input_ids=input_ids, aux=aux, position_ids=position_ids, first_slot=first_slot, valid=valid)

    def prefill(self, input_ids, aux, position_ids, valid):
        self.forwards += 1
        return self.run(input_ids, self.net.fc(aux.to(self.dtype)), position_ids,
                        torch.zeros(1, dtype=torch.long, device=self.device), valid)


def time_call(call: StaticCall, repeats: int = 200, warmup: int = 10) -> float:
    """Seconds per call of `call` on the inputs already in its buffers, synced before and after the repetitions."""
    import time

    device = next(iter(call.inputs.values())).device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        for _ in range(warmup):
            call.replay()
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            call.replay()
        sync()
    return (time.perf_counter() - start) / repeats


# ---------------------------------------------------------------- greedy loops: bookkeeping inside the calls
#
# At temperature 0 every choice is an argmax, so whole decoding steps (forwards plus the bookkeeping between them)
# are deterministic device work with fixed shapes: they are captured as graphs that read and advance device state
# in place, and the host only replays them and reads one small report per step. Sampling stays in
# draftline.speculative's eager loop over the pure forwards above: a graph replays a generator's draws only through
# the graph-safe generator registration (register_generator_state), whose offsets the eager reference would have
# to follow exactly; not worth it for a path that is not timed against the bound.
#
# These calls advance their state on every run, warm-up and replay alike, so they must never be replayed for
# timing (time_call uses the pure forwards, which rewrite the same slots each time). Their capture warm-ups run on
# zeroed state and advance the pointer by at most 2 * (k+1) slots; start() sets the real state afterwards.
# In static-eager mode (CPU, failed capture) the very same functions run eagerly, so the CPU tests cover the
# graph bodies.


class GreedyPlainStep:
    """One plain greedy step as one call: the target's T=1 forward, argmax, position and slot advance.

    The host replays this call sync_every times, copying each step's `token` into report_ring(sync_every), then
    reads the ring once (the window's one sync, for EOS and max_new_tokens).
    """

    def __init__(self, target: StaticTarget, use_graphs: bool):
        zeros = lambda *s: torch.zeros(*s, dtype=torch.long, device=target.device)  # noqa: E731
        self.target = target
        self.token = zeros(target.batch)  # each row's last emitted token: this step's input, then its output
        self.lengths = zeros(target.batch)  # logical (RoPE) position of `token`
        self.slot = zeros(1)  # physical slot `token` is written to (shared by all rows)
        self.ring: torch.Tensor | None = None
        self.call = StaticCall(self._step, {})
        self.capture_error = _capture_all({1: self.call}) if use_graphs else None

    def report_ring(self, sync_every: int) -> torch.Tensor:
        """[sync_every, B] device buffer: slot j holds step j's tokens of the current sync window."""
        if self.ring is None or self.ring.shape[0] != sync_every:
            self.ring = torch.zeros(sync_every, *self.token.shape, dtype=self.token.dtype, device=self.token.device)
        return self.ring

    @property
    def graphs(self) -> bool:
        return self.call.graph is not None

    def start(self, token: torch.Tensor, lengths: torch.Tensor, slot: int) -> None:
        self.token.copy_(token)
        self.lengths.copy_(lengths)
        self.slot.fill_(slot)

    def _step(self):
        logits, _ = self.target.run(self.token[:, None], self.lengths[:, None], self.slot)
        self.token.copy_(logits[:, -1].argmax(-1))
        self.lengths.add_(1)
        self.slot.add_(1)
        return (self.token,)

    def __call__(self) -> torch.Tensor:
        """Queue one step; returns `token` (read it before the next call overwrites it)."""
        self.target.forwards += 1
        self.call()
        return self.token


class GreedySpecIteration:
    """One greedy speculative iteration as three calls over device state, in draftline.speculative's eager order:

      chain:  k greedy drafts (argmax over the draft vocabulary, mapped to target ids) with the k-1 drafter T=1
              steps between them, written into the verify input [pending, d_1..d_k];
      verify: the target's T=k+1 forward, then greedy verification (argmax, accepted = length of the matching
              prefix via cumprod, bonus token), rejected slots masked, the drafter's read inputs and the report;
      read:   the drafter's T=k+1 read of the verified slots, its state at the last accepted position kept for the
              next chain, the slot pointer and positions advanced.

    chain and read belong to the drafter, verify to the target; each side falls back to static-eager on its own if
    its capture fails (capture_errors). Per iteration the host replays three calls and copies `report` [B, k+2]
    (accepted, drafts, bonus) into report_ring(sync_every) on the device; after sync_every iterations it reads the
    ring once: that is the window's one sync and all its eager work besides Python's bookkeeping of the tokens.
    """

    def __init__(self, target: StaticTarget, drafter: StaticDrafter, k: int, use_graphs: bool):
        cfg = drafter.net.config
        device, batch = target.device, target.batch
        zeros = lambda *s, dtype=torch.long: torch.zeros(*s, dtype=dtype, device=device)  # noqa: E731
        self.target, self.drafter, self.k = target, drafter, k
        self.offsets = torch.arange(k + 1, device=device)
        self.draft_to_target_ids = drafter.net.draft_token_ids.to(device)  # target id of each draft-vocabulary entry
        # Carried from one iteration to the next.
        self.base = zeros(1)  # first free slot, both caches
        self.lengths = zeros(batch)  # logical position of each row's pending token
        self.pending = zeros(batch)  # last emitted token (the bonus), not yet in the caches
        self.last_logits = zeros(batch, cfg.draft_vocab_size, dtype=torch.float32)  # drafter's guess for draft 1
        self.last_hidden = zeros(batch, 1, cfg.hidden_size, dtype=drafter.dtype)
        # Handed from one call to the next within an iteration.
        self.verify_ids = zeros(batch, k + 1)
        self.read_ids = zeros(batch, k + 1)
        self.read_aux = zeros(batch, k + 1, 3 * cfg.target_hidden_size, dtype=drafter.dtype)
        self.read_valid = zeros(batch, k + 1, dtype=torch.bool)
        self.accepted = zeros(batch)
        self.report = zeros(batch, k + 2)
        self.ring: torch.Tensor | None = None
        self.chain = StaticCall(self._draft_chain, {})
        self.verify = StaticCall(self._verify, {})
        self.read = StaticCall(self._read_verified, {})
        self.drafter_capture_error = self.target_capture_error = None
        if use_graphs:
            self.drafter_capture_error = _capture_all({0: self.chain, 1: self.read})
            self.target_capture_error = _capture_all({0: self.verify})

    def report_ring(self, sync_every: int) -> torch.Tensor:
        """[sync_every, B, k+2] device buffer: slot j holds iteration j's report of the current sync window."""
        if self.ring is None or self.ring.shape[0] != sync_every:
            self.ring = torch.zeros(sync_every, *self.report.shape, dtype=self.report.dtype, device=self.report.device)
        return self.ring

    @property
    def captured(self) -> tuple[bool, bool]:
        """(target side, drafter side) replay as graphs."""
        return self.verify.graph is not None, self.chain.graph is not None and self.read.graph is not None

    @property
    def capture_errors(self) -> list[str]:
        return [e for e in (self.target_capture_error, self.drafter_capture_error) if e]

    def start(self, base: int, lengths, pending, last_logits, last_hidden) -> None:
        """State after prefill: the pointer, each row's pending token and position, the drafter's last output."""
        self.base.fill_(base)
        self.lengths.copy_(lengths)
        self.pending.copy_(pending)
        self.last_logits.copy_(last_logits)
        self.last_hidden.copy_(last_hidden)

    def _draft_chain(self):
        # Draft step j and verified token j share position lengths + j and slot base + j (the read overwrites it).
        positions = self.lengths[:, None] + self.offsets
        slots = self.base + self.offsets
        logits, hidden = self.last_logits, self.last_hidden
        self.verify_ids[:, 0].copy_(self.pending)
        for j in range(self.k):
            draft = self.draft_to_target_ids[logits.argmax(-1)]
            self.verify_ids[:, j + 1].copy_(draft)
            if j + 1 < self.k:
                logits, hidden = self.drafter.run(draft[:, None], hidden, positions[:, j:j + 1], slots[j:j + 1])
                logits = logits[:, -1]
        return (self.verify_ids,)

    def _verify(self):
        k = self.k
        positions = self.lengths[:, None] + self.offsets
        logits, aux = self.target.run(self.verify_ids, positions, self.base)
        drafts = self.verify_ids[:, 1:]
        best = logits.argmax(-1)  # [B, k+1]
        accepted = (best[:, :k] == drafts).long().cumprod(1).sum(1)
        bonus = best.gather(1, accepted[:, None])  # [B, 1]
        # Rejected slots become masked holes; slots past the longest accepted run are overwritten next time.
        kept = self.offsets[None, :] <= accepted[:, None]
        self.target.key_valid.index_copy_(1, self.base + self.offsets, kept)
        # The drafter reads each verified slot paired with the token after it; after the last accepted: the bonus.
        self.read_ids[:, :k].copy_(drafts)
        self.read_ids[:, k:].copy_(bonus)
        self.read_ids.scatter_(1, accepted[:, None], bonus)
        self.read_aux.copy_(aux)
        self.read_valid.copy_(kept)
        self.accepted.copy_(accepted)
        self.pending.copy_(bonus[:, 0])
        self.report[:, :1].copy_(accepted[:, None])
        self.report[:, 1:k + 1].copy_(drafts)
        self.report[:, k + 1:].copy_(bonus)
        return (self.report,)

    def _read_verified(self):
        positions = self.lengths[:, None] + self.offsets
        logits, hidden = self.drafter.run(self.read_ids, self.drafter.net.fc(self.read_aux), positions, self.base,
                                          self.read_valid)
        at = self.accepted[:, None, None]
        self.last_logits.copy_(logits.gather(1, at.expand(-1, 1, logits.shape[-1]))[:, 0])
        self.last_hidden.copy_(hidden.gather(1, at.expand(-1, 1, hidden.shape[-1])))
        # The pointer moves past the longest accepted run of any row; each row's position by its own run.
        self.base.add_(self.accepted.max() + 1)
        self.lengths.add_(self.accepted + 1)
        return (self.last_logits,)

    def __call__(self) -> torch.Tensor:
        """Queue one iteration; returns `report` [B, k+2] (read it before the next call overwrites it)."""
        self.drafter.forwards += self.k  # k-1 draft steps and the read, as the eager path counts them
        self.target.forwards += 1
        self.chain()
        self.verify()
        self.read()
        return self.report
