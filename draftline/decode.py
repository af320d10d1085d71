"""Reference EAGLE-3 speculative decoding in plain torch on a transformers target: ground-truth acceptance and speedup.

Chain drafting only: one candidate per draft position (EAGLE "top-k 1"); tree drafting is NOT implemented.

Definitions follow vLLM's counters, so engine figures and this decoder's compare directly:
  * a "draft" is one target verification step that checked k draft tokens;
  * mean acceptance length = 1 + accepted draft tokens / drafts (tokens produced per verification step);
  * per-position acceptance i = drafts whose i-th draft token was accepted / drafts.
Acceptance is counted as the verifier decided it, before output is cut at EOS or max_new_tokens (as vLLM does).

Greedy verification (temperature 0) reproduces plain greedy decoding of the target token for token (tested exact in
float32; in bf16 the k+1-token verify forward may round differently from a 1-token step and flip a near tie); sampling uses
the standard rejection rule (accept a draft token with probability min(1, p/q), else sample norm(max(0, p - q))),
so its output is distributed exactly as the target's own samples.

Batches hold rows that advance by different amounts; rejected positions stay in the KV caches as masked holes
(each row keeps its own RoPE positions), so rows never wait for each other. Finished rows keep computing until the
whole batch is done (no compaction): use batch 1, the default, for timing.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from draftline.aux_ids import AuxLayerIds, outside
from draftline.config import DEFAULT_K
from draftline.errors import ConfigError
from draftline.target import capture_hidden_states, decoder_layers, resolve_device

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# The precision a reference run is repeated in to see how far numerics alone move acceptance (engines serve bf16).
_OTHER_PRECISION = {"float32": "bfloat16", "bfloat16": "float32", "float16": "float32"}


# ---------------------------------------------------------------- statistics

@dataclass
class AcceptanceStats:
    """Acceptance counters of a speculative run, in vLLM's definitions."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # Entry a = drafts that accepted exactly a draft tokens (acceptance length a + 1), a = 0..k.
    accepted_histogram: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_position = self.accepted_per_position or [0] * self.k
        self.accepted_histogram = self.accepted_histogram or [0] * (self.k + 1)

    def record(self, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += self.k
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        self.accepted_histogram[accepted] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else float("nan") for a in self.accepted_per_position]

    @property
    def conditional_acceptance(self) -> list[float | None]:
        """P(draft i accepted | draft i-1 accepted): what training's per-step top-1 accuracy estimates (None: no case)."""
        out, prev = [], self.num_drafts
        for a in self.accepted_per_position:
            out.append(a / prev if prev else None)
            prev = a
        return out

    def summary(self) -> dict:
        return {
            **asdict(self),
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "conditional_acceptance": self.conditional_acceptance,
        }


def expected_acceptance(step_accuracies: Sequence[float], k: int | None = None) -> dict:
    """Offline estimate from training validation, in the same definitions as a decoding run.

    step_accuracies[j] is the drafter's top-1 accuracy at training-time-test step j, measured with the true
    previous tokens as inputs, i.e. the chance that draft j is right given drafts 0..j-1 were. Under chain
    drafting with greedy verification, draft j is accepted iff all of 0..j are right, so
        per-position acceptance j = prod_{i<=j} acc_i,   mean acceptance length = 1 + sum_j prod_{i<=j} acc_i.
    With k larger than the measured steps, the last accuracy is repeated (a stated assumption).
    """
    accs = [float(a) for a in step_accuracies]
    if not accs or any(not 0.0 <= a <= 1.0 for a in accs):
        raise ConfigError(f"step accuracies {accs} must be a non-empty list of numbers between 0 and 1")
    k = len(accs) if k is None else int(k)
    if k < 1:
        raise ConfigError(f"k={k} must be at least 1 (the number of draft tokens per step)")
    accs = (accs + [accs[-1]] * k)[:k]
    per_position, running = [], 1.0
    for a in accs:
        running *= a
        per_position.append(running)
    return {"k": k, "mean_acceptance_length": 1.0 + sum(per_position), "per_position_acceptance": per_position}


@dataclass
class Generation:
    """Output of one decoding run over a batch of prompts."""

    tokens: list[list[int]]  # generated ids per prompt (cut at EOS inclusive, at most max_new_tokens)
    seconds: float
    target_forwards: int  # prefill included
    stats: AcceptanceStats | None = None  # None for plain decoding
    target_seconds: float = 0.0  # time inside target forwards, only when profiled
    drafter_seconds: float = 0.0  # time inside drafter forwards, only when profiled
    drafter_forwards: int = 0
    mode: str = "eager"  # "eager" | "static-eager" | "cuda-graphs" | "cuda-graphs-partial" (draftline.decode_static)
    setup_seconds: float = 0.0  # fast path: buffer allocation and graph capture, not part of `seconds`
    # Greedy fast path with sync_every > 1: target forwards that ran after every row had finished (inside the last
    # sync window, before the host looked) and whose output was discarded. They cost time (counted in `seconds`)
    # but are not in target_forwards / drafter_forwards, which count what sync_every=1 would run, so those stay
    # comparable across sync_every.
    discarded_target_forwards: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")


# ---------------------------------------------------------------- forwards with ragged rows

def _attention_bias(key_valid: torch.Tensor, query_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, T, S]: causal over physical slots, holes and padding masked.

    Each query also sees its own slot, so padding queries never have an empty row (which would give NaN
    values that leak into real rows through 0 * NaN).
    """
    b, s = key_valid.shape
    past = s - query_len
    key_pos = torch.arange(s, device=key_valid.device)
    query_pos = past + torch.arange(query_len, device=key_valid.device)
    causal = key_pos[None, :] <= query_pos[:, None]
    allowed = (key_valid[:, None, :] & causal[None]) | (key_pos[None, :] == query_pos[:, None])[None]
    bias = torch.zeros(b, 1, query_len, s, dtype=dtype, device=key_valid.device)
    return bias.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


class _Target:
    """A transformers causal LM with a KV cache whose slots may be masked, and aux-state capture when asked."""

    def __init__(self, model, aux_layer_ids: list[int] | None):
        self.model = model
        self.aux_layer_ids = aux_layer_ids
        self.cache = None
        self.key_valid: torch.Tensor | None = None  # [B, slots]
        self.forwards = 0

    @property
    def slots(self) -> int:
        return 0 if self.key_valid is None else self.key_valid.shape[1]

    @torch.no_grad()
    def forward(self, input_ids, position_ids, new_valid, last_only: bool = False):
        """Run T new tokens for every row; returns (logits [B,T,V] float32 (T=1 if last_only), aux [B,T,3H] or None)."""
        valid = new_valid if self.key_valid is None else torch.cat([self.key_valid, new_valid], dim=1)
        dtype = next(self.model.parameters()).dtype
        bias = _attention_bias(valid, input_ids.shape[1], dtype)
        captured: dict[str, torch.Tensor] = {}
        kwargs = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=bias,
                      past_key_values=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        if self.aux_layer_ids is not None:
            with capture_hidden_states(self.model, self.aux_layer_ids, captured.__setitem__):
                out = self.model(**kwargs)
            aux = torch.cat([captured["aux0"], captured["aux1"], captured["aux2"]], dim=-1)
        else:
            out = self.model(**kwargs)
            aux = None
        self.cache = out.past_key_values
        self.key_valid = valid
        self.forwards += 1
        return out.logits.float(), aux

    def keep(self, slots: int, valid_tail: torch.Tensor | None = None) -> None:
        """Drop slots beyond `slots`; optionally overwrite the validity of the last slots with valid_tail [B, n]."""
        drop = self.slots - slots
        if drop > 0:
            self.cache.crop(-drop)
            self.key_valid = self.key_valid[:, :slots]
        if valid_tail is not None and valid_tail.shape[1]:
            self.key_valid[:, slots - valid_tail.shape[1]:] = valid_tail


class _Drafter:
    """The EAGLE-3 head run over a DrafterCache whose slots may be masked (holes from rejected drafts, padding)."""

    def __init__(self, drafter):
        from draftline.drafter.model import DrafterCache

        self.net = drafter
        self.cache = DrafterCache()
        self.key_valid: torch.Tensor | None = None
        self.forwards = 0

    @property
    def slots(self) -> int:
        return 0 if self.key_valid is None else self.key_valid.shape[1]

    @torch.no_grad()
    def forward(self, input_ids, hidden, position_ids, new_valid):
        """Same computation as Eagle3Drafter.forward, plus a key mask; returns (logits float32, hidden_out)."""
        from draftline.drafter.model import repeat_kv

        net = self.net
        valid = new_valid if self.key_valid is None else torch.cat([self.key_valid, new_valid], dim=1)
        embeds = net.embed_tokens(input_ids).to(hidden.dtype)
        q, k, v = net.midlayer.qkv(embeds, hidden, position_ids)
        k, v = self.cache.append(k, v)
        groups = net.config.num_attention_heads // net.config.num_key_value_heads
        bias = _attention_bias(valid, input_ids.shape[1], q.dtype)
        attn = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=bias)
        hidden_out = net.midlayer.finish(hidden, attn)
        logits = net.lm_head(net.norm(hidden_out))
        self.key_valid = valid
        self.forwards += 1
        return logits.float(), hidden_out

    def keep(self, slots: int) -> None:
        if self.slots > slots:
            self.cache.crop(slots)
            self.key_valid = self.key_valid[:, :slots]


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, N], valid [B, N], position_ids [B, N]) with prompts right-aligned."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt must have at least one token; drop empty prompts from the prompt set")
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), n), dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, n - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        valid[row, n - len(p):] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    return ids.to(device), valid.to(device), positions.to(device)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _pick(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    if temperature == 0.0:
        return logits.argmax(-1)
    return _sample(torch.softmax(logits / temperature, dim=-1), generator)


class _Rows:
    """Per-row output bookkeeping: emitted tokens, stop at EOS or max_new_tokens."""

    def __init__(self, batch: int, max_new_tokens: int, eos_ids: Sequence[int]):
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.active = [True] * batch
        self.max_new_tokens = max_new_tokens
        self.eos = set(int(e) for e in eos_ids)

    def emit(self, row: int, new: Sequence[int]) -> None:
        for t in new:
            if not self.active[row]:
                return
            self.tokens[row].append(int(t))
            if int(t) in self.eos or len(self.tokens[row]) >= self.max_new_tokens:
                self.active[row] = False

    @property
    def any_active(self) -> bool:
        return any(self.active)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


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


def _window(rows: "_Rows", sync_every: int, free_slots: int, slots_per_step: int) -> int:
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
    _sync(device)
    start = time.perf_counter()
    target = _Target(model, None)
    ids, valid, positions = _left_pad(prompts, pad_token_id, device)
    rows = _Rows(len(prompts), max_new_tokens, eos_token_ids)
    logits, _ = target.forward(ids, positions, valid, last_only=True)
    nxt = _pick(logits[:, -1], temperature, generator)
    lengths = valid.sum(1)
    for row, t in enumerate(nxt.tolist()):
        rows.emit(row, [t])
    ones = torch.ones(len(prompts), 1, dtype=torch.bool, device=device)
    while rows.any_active:
        logits, _ = target.forward(nxt[:, None], lengths[:, None], ones)
        lengths = lengths + 1
        nxt = _pick(logits[:, -1], temperature, generator)
        for row, t in enumerate(nxt.tolist()):
            rows.emit(row, [t])
    _sync(device)
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
    ids, valid, positions = _left_pad(prompts, pad_token_id, device)
    _sync(device)
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
    _sync(device)
    start = time.perf_counter()
    rows = _Rows(len(prompts), max_new_tokens, eos_token_ids)
    logits, _ = target.prefill(ids, positions, valid)
    nxt = _pick(logits[:, -1], temperature, generator)
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
            nxt = _pick(logits[:, -1], temperature, generator)
            for row, t in enumerate(nxt.tolist()):
                rows.emit(row, [t])
        captured = target.graphs
    _sync(device)
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
        _sync(device)
        start = time.perf_counter()

        k, temp, batch = self.k, self.temperature, len(prompts)
        target, drafter = _Target(self.model, self.aux_layer_ids), _Drafter(self.drafter)
        stats = AcceptanceStats(k=k)
        rows = _Rows(batch, max_new_tokens, self.eos_token_ids)
        hidden_dtype = self.drafter.fc.weight.dtype
        arange_b = torch.arange(batch, device=device)

        # Prefill: the target reads the prompt and picks the first token; the drafter reads the same slots,
        # each target hidden state paired with the following token (the last one with the first new token).
        ids, valid, positions = _left_pad(prompts, self.pad_token_id, device)
        with timer.target():
            logits, aux = target.forward(ids, positions, valid, last_only=True)
        first = _pick(logits[:, -1], temp, generator)
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

        _sync(device)
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
        ids, valid, positions = _left_pad(prompts, self.pad_token_id, device)
        _sync(device)
        setup_start = time.perf_counter()
        sync_every = self.sync_every if temp == 0.0 else 1
        target, drafter = self._static_runners(batch, slots_needed(ids.shape[1], max_new_tokens, k, batch, sync_every))
        greedy = self._greedy_iteration(target, drafter) if temp == 0.0 else None
        if greedy is not None:
            greedy.report_ring(sync_every)  # allocated here, outside the timed decoding
        target.reset()
        drafter.reset()
        _sync(device)
        start = time.perf_counter()

        stats = AcceptanceStats(k=k)
        rows = _Rows(batch, max_new_tokens, self.eos_token_ids)
        arange_b = torch.arange(batch, device=device)
        offsets = torch.arange(k + 1, device=device)

        with timer.target():
            logits, aux = target.prefill(ids, positions, valid)
        first = _pick(logits[:, -1], temp, generator)
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

        _sync(device)
        return Generation(tokens=rows.tokens, seconds=time.perf_counter() - start, target_forwards=target.forwards,
                          stats=stats, target_seconds=timer.target_s, drafter_seconds=timer.drafter_s,
                          drafter_forwards=drafter.forwards, mode=_static_mode(target.graphs, drafter.graphs),
                          setup_seconds=start - setup_start)

    def _greedy_loop(self, greedy, base: int, lengths, pending, last_logits, last_hidden, rows: "_Rows",
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
        _sync(device)
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
            idx = _sample(probs, generator)
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
        return accepted, _sample(dist, generator)


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
            _sync(self.timer.device)
            self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.timer.enabled:
            _sync(self.timer.device)
            setattr(self.timer, self.attr, getattr(self.timer, self.attr) + time.perf_counter() - self.start)


# ---------------------------------------------------------------- reference acceptance of a drafter on a prompt set

@dataclass
class ReferenceResult:
    """Ground-truth acceptance of a drafter on a prompt set, with speedup over plain decoding in the same run."""

    target: str
    drafter: str
    k: int
    temperature: float
    draft_sampling: str
    dtype: str
    device: str
    batch_size: int
    num_prompts: int
    max_new_tokens: int
    stats: AcceptanceStats
    spec_tokens: int
    spec_seconds: float
    plain_tokens: int
    plain_seconds: float
    greedy_outputs_match: bool | None  # temperature 0: speculative output == plain greedy output, every prompt
    target_forwards_spec: int
    target_forwards_plain: int
    mode: str = "eager"  # the speculative run's implementation (Generation.mode)
    plain_mode: str = "eager"
    aux_shifts: list[dict] = field(default_factory=list)  # the same drafter fed neighbouring layers (variant_runs)
    other_precision: dict | None = None  # the same decode in another precision: how far numerics alone move it

    @property
    def spec_tokens_per_s(self) -> float:
        return self.spec_tokens / self.spec_seconds if self.spec_seconds > 0 else float("nan")

    @property
    def plain_tokens_per_s(self) -> float:
        return self.plain_tokens / self.plain_seconds if self.plain_seconds > 0 else float("nan")

    @property
    def speedup(self) -> float:
        return self.spec_tokens_per_s / self.plain_tokens_per_s

    def summary(self) -> dict:
        """JSON-ready figures; acceptance keys use the same names as the engine results."""
        s = self.stats
        return {
            "engine": "reference decoder (torch, chain drafting)",
            "target": self.target, "drafter": self.drafter, "k": self.k, "temperature": self.temperature,
            "draft_sampling": self.draft_sampling,
            "dtype": self.dtype, "device": self.device, "batch_size": self.batch_size,
            "num_prompts": self.num_prompts, "max_new_tokens": self.max_new_tokens,
            "mean_acceptance_length": s.mean_acceptance_length,
            "per_position_acceptance": s.per_position_acceptance,
            "conditional_acceptance": s.conditional_acceptance,
            "accepted_histogram": s.accepted_histogram,
            "num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens, "accepted_per_position": s.accepted_per_position,
            "spec_tokens": self.spec_tokens, "spec_seconds": self.spec_seconds,
            "spec_tokens_per_s": self.spec_tokens_per_s,
            "plain_tokens": self.plain_tokens, "plain_seconds": self.plain_seconds,
            "plain_tokens_per_s": self.plain_tokens_per_s, "speedup": self.speedup,
            "greedy_outputs_match": self.greedy_outputs_match,
            "target_forwards_spec": self.target_forwards_spec, "target_forwards_plain": self.target_forwards_plain,
            "mode": self.mode, "plain_mode": self.plain_mode,
            "aux_shift_acceptance": self.aux_shifts,
            "other_precision_acceptance": self.other_precision,
        }


def variant_runs(decoder: "SpeculativeDecoder", batches: Sequence[Sequence[Sequence[int]]], max_new_tokens: int,
                 reference: AcceptanceStats, seed: int, shifts: Sequence[int] = (),
                 other: tuple[str, Callable[[], tuple]] | None = None) -> tuple[list[dict], dict | None]:
    """The reference decode again with one thing changed, on the same batches: the drafter fed the layers `shift`
    away from its trained ones (every id moved alike, as a convention mix-up moves them), or target and drafter in
    another precision (other: its dtype name and a loader of (target, drafter) in it). Each row gives its acceptance
    and `kept_share`, the share of accepted draft tokens per step it keeps: what wrong ids would cost on this target,
    and how far numerics alone move acceptance."""
    trained = AuxLayerIds.of(decoder.aux_layer_ids)
    base = reference.mean_acceptance_length - 1.0
    num_layers = len(decoder_layers(decoder.model))

    def decode(model, drafter, ids) -> dict:
        variant = SpeculativeDecoder(model, drafter, decoder.k, temperature=decoder.temperature,
                                     eos_token_ids=decoder.eos_token_ids, pad_token_id=decoder.pad_token_id,
                                     seed=decoder.seed, draft_sampling=decoder.draft_sampling, fast=decoder.fast,
                                     sync_every=decoder.sync_every, aux_layer_ids=ids)
        stats, start = AcceptanceStats(k=decoder.k), 0
        for batch in batches:
            _merge(stats, variant.generate(batch, max_new_tokens, seed=seed + start).stats)
            start += len(batch)
        length = stats.mean_acceptance_length
        return {"mean_acceptance_length": length, "kept_share": (length - 1.0) / base if base > 0 else None}

    shifted = []
    for shift in shifts:
        ids = trained.shifted(shift)
        row: dict = {"shift": shift, "aux_layer_ids": ids}
        if outside(ids, num_layers):
            shifted.append({**row, "skipped": f"layers {ids} are outside the target's 0..{num_layers - 1}"})
            continue
        shifted.append({**row, **decode(decoder.model, decoder.drafter, ids)})
    other_row = None
    if other is not None:
        # Loaded afresh: casting the caller's target there and back would not give its weights back bit for bit.
        model, drafter = other[1]()
        other_row = {"dtype": other[0], **decode(model, drafter, trained.as_list())}
        del model, drafter
    return shifted, other_row


def eos_token_ids(target_dir: str | Path, tokenizer) -> list[int]:
    """EOS ids from generation_config.json and the tokenizer: the engines stop at any of them."""
    import json

    ids: set[int] = set()
    gen = Path(target_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def load_drafter(drafter_dir: str | Path, target_model, dtype: torch.dtype, device: str):
    """An Eagle3Drafter from a drafter directory, checked against the target, on device in dtype."""
    from draftline.drafter.eagle_format import load_eagle_dir

    drafter = load_eagle_dir(
        drafter_dir, embed_tokens=target_model.get_input_embeddings().weight.detach().float().cpu(),
        target_num_layers=len(decoder_layers(target_model)))
    return drafter.to(device=device, dtype=dtype).eval()


def reference_acceptance(target_dir, drafter_dir, prompts, k: int = DEFAULT_K, max_new_tokens: int = 128,
                         device: str = "auto", dtype: str = "float32", *, temperature: float = 0.0,
                         max_prompts: int | None = None, use_chat_template: bool = True, batch_size: int = 1,
                         seed: int = 0, draft_sampling: str = "greedy", target=None, fast: bool | None = None,
                         sync_every: int | None = None, aux_shifts: Sequence[int] = (),
                         other_precision: bool = False) -> dict:
    """Acceptance of `drafter_dir` on `prompts` (a prompts .jsonl path or contract-B dicts), as JSON-ready figures.

    Prompts are encoded as the engines see them (chat template with generation prompt for messages). Plain
    decoding of the same prompts runs in the same process for the speedup. See run_reference for the result object.
    fast: decode with the static-cache path (CUDA graphs on CUDA), None = on for CUDA; the summary's "mode" says which ran.
    sync_every: greedy fast-path steps per host sync, as in SpeculativeDecoder (None = 8 on CUDA, 1 elsewhere).
    """
    return run_reference(target_dir, drafter_dir, prompts, k, max_new_tokens, device, dtype, temperature=temperature,
                         max_prompts=max_prompts, use_chat_template=use_chat_template, batch_size=batch_size,
                         seed=seed, draft_sampling=draft_sampling, target=target, fast=fast,
                         sync_every=sync_every, aux_shifts=aux_shifts,
                         other_precision=other_precision).summary()


def run_reference(target_dir, drafter_dir, prompts, k: int = DEFAULT_K, max_new_tokens: int = 128, device: str = "auto",
                  dtype: str = "float32", *, temperature: float = 0.0, max_prompts: int | None = None,
                  use_chat_template: bool = True, batch_size: int = 1, seed: int = 0, draft_sampling: str = "greedy",
                  target=None, fast: bool | None = None, sync_every: int | None = None,
                  aux_shifts: Sequence[int] = (), other_precision: bool = False) -> ReferenceResult:
    """Like reference_acceptance, returning the ReferenceResult; `target` = an already loaded (model, tokenizer).
    aux_shifts: also decode with the drafter fed layers moved by each shift; other_precision: also decode in
    bfloat16 (float32 when dtype is bfloat16); both on the same prompts (variant_runs)."""
    from draftline.target import load_target
    from draftline.traces import encode_prompt, read_prompts

    if dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be at least 1")
    device = resolve_device(device)
    rows = read_prompts(prompts) if isinstance(prompts, (str, Path)) else list(prompts)
    if not rows:
        raise ConfigError("the prompt set is empty; pass a prompts .jsonl file with at least one prompt")
    rows = rows[:max_prompts] if max_prompts else rows
    model, tokenizer = target if target is not None else load_target(target_dir, dtype, device)
    drafter = load_drafter(drafter_dir, model, _DTYPES[dtype], device)
    encoded = [encode_prompt(tokenizer, p, use_chat_template) for p in rows]
    eos = eos_token_ids(target_dir, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    decoder = SpeculativeDecoder(model, drafter, k, temperature=temperature, eos_token_ids=eos, pad_token_id=pad,
                                 seed=seed, draft_sampling=draft_sampling, fast=fast, sync_every=sync_every)

    # Warm-up outside the timed region: first calls pay for allocator growth and kernel selection (and the fast
    # path's capture, which a batch that needs more capacity pays again, outside `seconds` too).
    decoder.generate(encoded[:1], min(4, max_new_tokens))
    plain_decode(model, encoded[:1], min(4, max_new_tokens), eos_token_ids=eos, pad_token_id=pad, fast=fast,
                 sync_every=sync_every)

    stats = AcceptanceStats(k=k)
    spec_tokens = plain_tokens = spec_fw = plain_fw = 0
    spec_s = plain_s = 0.0
    match = True
    modes = {"spec": set(), "plain": set()}
    for start in range(0, len(encoded), batch_size):
        batch = encoded[start:start + batch_size]
        plain = plain_decode(model, batch, max_new_tokens, temperature=temperature, eos_token_ids=eos,
                             pad_token_id=pad, seed=seed + start, fast=fast, sync_every=sync_every)
        spec = decoder.generate(batch, max_new_tokens, seed=seed + start)
        _merge(stats, spec.stats)
        spec_tokens, spec_s, spec_fw = spec_tokens + spec.num_tokens, spec_s + spec.seconds, spec_fw + spec.target_forwards
        plain_tokens, plain_s, plain_fw = plain_tokens + plain.num_tokens, plain_s + plain.seconds, plain_fw + plain.target_forwards
        match = match and spec.tokens == plain.tokens
        modes["spec"].add(spec.mode)
        modes["plain"].add(plain.mode)
    def load_other():
        other_model, _ = load_target(target_dir, _OTHER_PRECISION[dtype], device)
        return other_model, load_drafter(drafter_dir, other_model, _DTYPES[_OTHER_PRECISION[dtype]], device)

    shifted, other = variant_runs(decoder, [encoded[i:i + batch_size] for i in range(0, len(encoded), batch_size)],
                                  max_new_tokens, stats, seed, aux_shifts,
                                  (_OTHER_PRECISION[dtype], load_other) if other_precision else None)
    return ReferenceResult(
        target=str(target_dir), drafter=str(drafter_dir), k=k, temperature=temperature, draft_sampling=draft_sampling,
        dtype=dtype, device=device,
        batch_size=batch_size, num_prompts=len(encoded), max_new_tokens=max_new_tokens, stats=stats,
        spec_tokens=spec_tokens, spec_seconds=spec_s, plain_tokens=plain_tokens, plain_seconds=plain_s,
        greedy_outputs_match=match if temperature == 0.0 else None,
        target_forwards_spec=spec_fw, target_forwards_plain=plain_fw,
        mode="+".join(sorted(modes["spec"])), plain_mode="+".join(sorted(modes["plain"])),
        aux_shifts=shifted, other_precision=other)


def _merge(total: AcceptanceStats, part: AcceptanceStats) -> None:
    total.num_drafts += part.num_drafts
    total.num_draft_tokens += part.num_draft_tokens
    total.num_accepted_tokens += part.num_accepted_tokens
    total.accepted_per_position = [a + b for a, b in zip(total.accepted_per_position, part.accepted_per_position)]
    total.accepted_histogram = [a + b for a, b in zip(total.accepted_histogram, part.accepted_histogram)]
