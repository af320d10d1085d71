"""Traces → hidden-state shards: one hooked forward per length-bucketed batch, bf16 capture, overlapped copies and writes."""
from __future__ import annotations

import io
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import torch

if TYPE_CHECKING:  # the benchmark runs this module on GPU machines that have torch and transformers only
    from draftline.config import ExtractConfig
from draftline.errors import ConfigError
from draftline.shards import finished_shard, publish_shard, shard_records, spec_hash, write_stage_manifest
from draftline.target import (
    VLLM, capture_hidden_states, decoder_model, load_target, num_layers, read_target_config, target_fingerprint,
    validate_aux_layer_ids,
)

STAGE = "hidden"
SUFFIX = ".safetensors"
TRACES_STAGE = "traces"


# ---------------------------------------------------------------- planning

@dataclass(frozen=True)
class ShardPlan:
    """Which traces go into one hidden-state shard: (trace shard key, first line, end line) ranges, in order."""

    index: int
    ranges: list[tuple[str, int, int]]
    tokens: int
    sequences: int


def _trace_entries(store, run: str):
    manifest = store.read_manifest(f"{run}/{TRACES_STAGE}")
    if manifest is None:
        raise ConfigError(f"{store.uri(run + '/' + TRACES_STAGE)} has no manifest.json; run trace generation for run {run!r} first")
    return [e for e in manifest if e.key.rsplit("/", 1)[-1].startswith("shard-") and e.key.endswith(".jsonl")]


def _read_traces(store, key: str, expect=None) -> list[dict]:
    return [json.loads(x) for x in store.get_bytes(key, expect=expect).decode("utf-8").splitlines() if x.strip()]


def plan_hidden_shards(cfg: ExtractConfig, store, run: str) -> list[ShardPlan]:
    """Group traces, in order, into shards of about cfg.tokens_per_shard tokens; cached in `<run>/hidden/_plan.json`."""
    entries = _trace_entries(store, run)
    basis = spec_hash({"traces": [(e.key, e.sha256) for e in entries], "tokens_per_shard": cfg.tokens_per_shard})
    plan_key = f"{run}/{STAGE}/_plan.json"
    if store.exists(plan_key):
        cached = json.loads(store.get_bytes(plan_key))
        if cached.get("basis") == basis:
            return [ShardPlan(i, [tuple(r) for r in s["ranges"]], s["tokens"], s["sequences"])
                    for i, s in enumerate(cached["shards"])]
    shards, current, tokens, seqs = [], [], 0, 0

    def close():
        nonlocal current, tokens, seqs
        if seqs:
            shards.append({"ranges": current, "tokens": tokens, "sequences": seqs})
        current, tokens, seqs = [], 0, 0

    for e in entries:
        for line, trace in enumerate(_read_traces(store, e.key, expect=e)):
            n = len(trace["input_ids"])
            if seqs and tokens + n > cfg.tokens_per_shard:
                close()
            if current and current[-1][0] == e.key and current[-1][2] == line:
                current[-1][2] = line + 1
            else:
                current.append([e.key, line, line + 1])
            tokens += n
            seqs += 1
    close()
    if not shards:
        raise ConfigError(f"run {run!r} has no traces to extract; check the trace stage's stats.json (all filtered out?)")
    store.put_bytes(plan_key, json.dumps({"basis": basis, "shards": shards}).encode())
    return [ShardPlan(i, [tuple(r) for r in s["ranges"]], s["tokens"], s["sequences"]) for i, s in enumerate(shards)]


def num_hidden_shards(cfg: ExtractConfig, store, run: str) -> int:
    return len(plan_hidden_shards(cfg, store, run))


def length_buckets(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Batches of sequence indices, longest first, each padded batch within batch_tokens (a longer sequence goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


# ---------------------------------------------------------------- the extractor

def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("extract.device is 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device(device)


class HiddenStateExtractor:
    """Holds a loaded target with hooks on the aux layers and the final norm; turns token sequences into host tensors.

    Each batch: one forward of the decoder stack (no lm_head), the hooks gather the real (unpadded) tokens of each
    captured tensor into a bf16 device staging buffer, and one contiguous copy moves it into a pinned host buffer on
    a side stream, so the next batch computes while the copy runs.
    """

    def __init__(self, target_dir: str | Path | None, aux_layer_ids: list[int] | None = None, device: str = "auto",
                 dtype: str = "bfloat16", model=None):
        self.target_dir = str(target_dir) if target_dir is not None else None
        if self.target_dir is None and model is None:
            raise ConfigError("HiddenStateExtractor needs a target directory or a loaded model; pass target_dir")
        # Validate ids against the config before loading any weights.
        depth = num_layers(read_target_config(self.target_dir)) if self.target_dir else num_layers(model)
        self.aux_layer_ids = validate_aux_layer_ids(aux_layer_ids, depth)
        self.device = resolve_device(device)
        self.model = model if model is not None else load_target(self.target_dir, dtype, self.device)[0]
        self.decoder = decoder_model(self.model)
        self.hidden_size = int(self.model.config.get_text_config().hidden_size)
        # A model handed over in memory (benchmarks) has no files to hash.
        self.fingerprint = target_fingerprint(self.target_dir) if self.target_dir else "in-memory"
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._staging: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = []

    def host_buffers(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host tensors for one shard. On CUDA they are pinned and recycled from a ring of two (pinning is slow),
        so a result stays valid until two more shards were extracted: one being written, one being computed."""
        h = self.hidden_size
        if not self._cuda:
            return torch.empty((tokens, 3 * h), dtype=torch.bfloat16), torch.empty((tokens, h), dtype=torch.bfloat16)
        self._ring_next = (getattr(self, "_ring_next", -1) + 1) % 2
        ring = self.__dict__.setdefault("_ring", [None, None])
        slot = ring[self._ring_next]
        if slot is None or slot[0].shape[0] < tokens:
            slot = (torch.empty((tokens, 3 * h), dtype=torch.bfloat16, pin_memory=True),
                    torch.empty((tokens, h), dtype=torch.bfloat16, pin_memory=True))
            ring[self._ring_next] = slot
        return slot[0][:tokens], slot[1][:tokens]

    def _stage(self, slot: int, n: int):
        """Device staging buffers for `n` tokens, two slots used alternately (reuse waits for that slot's copy)."""
        while len(self._staging) <= slot:
            self._staging.append((torch.empty(0), torch.empty(0), None))
        aux, last, event = self._staging[slot]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        if aux.shape[0] < n:
            h = self.hidden_size
            aux = torch.empty((n, 3 * h), dtype=torch.bfloat16, device=self.device)
            last = torch.empty((n, h), dtype=torch.bfloat16, device=self.device)
            self._staging[slot] = (aux, last, None)
        return aux[:n], last[:n]

    @torch.inference_mode()
    def extract_into(self, sequences: list[list[int]], order: list[list[int]], offsets: list[int],
                     aux_out: torch.Tensor, last_out: torch.Tensor) -> None:
        """Run every batch of `order` (lists of sequence indices) and fill rows offsets[i].. of aux_out/last_out."""
        h = self.hidden_size
        pad = 0
        for b, batch in enumerate(order):
            lengths = [len(sequences[i]) for i in batch]
            width = max(lengths)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : lengths[row]] = torch.tensor(sequences[i], dtype=torch.long)
            # Flat positions of real tokens, row by row; right padding + causal attention leaves them unaffected.
            flat = torch.cat([torch.arange(row * width, row * width + n) for row, n in enumerate(lengths)])
            n_tok = flat.numel()
            start = offsets[batch[0]]
            if self._cuda:
                stage_aux, stage_last = self._stage(b % 2, n_tok)
                ids = ids.pin_memory().to(self.device, non_blocking=True)
                flat = flat.pin_memory().to(self.device, non_blocking=True)
            else:  # on CPU the hooks write straight into the host buffer: no staging, no copy
                stage_aux, stage_last = aux_out[start:start + n_tok], last_out[start:start + n_tok]
            slots = {"aux0": 0, "aux1": 1, "aux2": 2}

            def sink(name, hidden):
                rows = hidden.reshape(-1, h).index_select(0, flat)
                if name == "last":
                    stage_last.copy_(rows)
                else:
                    s = slots[name]
                    stage_aux[:, s * h:(s + 1) * h].copy_(rows)

            with capture_hidden_states(self.model, self.aux_layer_ids, sink):
                self.decoder(input_ids=ids, use_cache=False)
            if self._cuda:
                compute = torch.cuda.current_stream(self.device)
                self._copy_stream.wait_stream(compute)
                with torch.cuda.stream(self._copy_stream):
                    aux_out[start:start + n_tok].copy_(stage_aux, non_blocking=True)
                    last_out[start:start + n_tok].copy_(stage_last, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._copy_stream)
                a, l, _ = self._staging[b % 2]
                self._staging[b % 2] = (a, l, event)
        if self._cuda:
            self._copy_stream.synchronize()

    def extract(self, sequences: list[list[int]], batch_tokens: int):
        """Sequences → (order, cu_seqlens, aux [N, 3H], last [N, H]); the shard keeps the longest-first batch order."""
        lengths = [len(s) for s in sequences]
        batches = length_buckets(lengths, batch_tokens)
        order = [i for batch in batches for i in batch]
        offsets = [0] * len(sequences)
        cu = [0]
        for i in order:
            offsets[i] = cu[-1]
            cu.append(cu[-1] + lengths[i])
        aux, last = self.host_buffers(cu[-1])
        self.extract_into(sequences, batches, offsets, aux, last)
        return order, torch.tensor(cu, dtype=torch.int64), aux, last


# ---------------------------------------------------------------- shards

def _shard_spec(extractor: HiddenStateExtractor, plan: ShardPlan, trace_sha: dict[str, str]) -> str:
    return spec_hash({
        "target": extractor.fingerprint, "aux": extractor.aux_layer_ids, "dtype": str(extractor.model.dtype),
        "ranges": [(k, trace_sha[k], a, b) for k, a, b in plan.ranges],
    })


def _load_shard_traces(store, plan: ShardPlan, entries) -> list[dict]:
    out, cache = [], {}
    for key, a, b in plan.ranges:
        if key not in cache:
            cache = {key: _read_traces(store, key, expect=entries.get(key))}
        out.extend(cache[key][a:b])
    return out


_ST_DTYPES = {torch.int64: "I64", torch.uint8: "U8", torch.bfloat16: "BF16", torch.float32: "F32"}


class SafetensorsStream(io.RawIOBase):
    """A safetensors file as a read-once stream: header, then each tensor's memory, with no copy into a file first.

    The header keys are sorted (safetensors' own writer orders metadata arbitrarily), so identical extractions give
    identical bytes and sha256; resumption and checks by checksum rely on that.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str]):
        header: dict = {"__metadata__": dict(sorted(metadata.items()))}
        offset, parts = 0, []
        for name in sorted(tensors):
            t = tensors[name].contiguous()
            size = t.numel() * t.element_size()
            header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
            offset += size
            if size:
                parts.append(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format allows trailing spaces; 8-byte alignment keeps tensors aligned
        self._parts = [memoryview(len(raw).to_bytes(8, "little")), memoryview(raw)] + parts
        self._tensors = tensors  # keep the memory alive while streaming
        self.size = 8 + len(raw) + offset

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self._parts and not len(self._parts[0]):
            self._parts.pop(0)
        if not self._parts:
            return 0
        head = self._parts[0]
        n = min(len(buf), len(head))
        buf[:n] = head[:n]
        self._parts[0] = head[n:]
        return n


def _write_shard(store, run: str, plan: ShardPlan, spec: str, extractor: HiddenStateExtractor, traces: list[dict],
                 order: list[int], cu: torch.Tensor, aux: torch.Tensor, last: torch.Tensor) -> dict:
    """Serialize one shard to a local temp file (contract D), upload it, publish its completion record."""
    ids = torch.tensor([t for i in order for t in traces[i]["input_ids"]], dtype=torch.int64)
    mask = torch.tensor([m for i in order for m in traces[i]["loss_mask"]], dtype=torch.uint8)
    meta = {"aux_layer_ids": json.dumps(extractor.aux_layer_ids), "convention": VLLM,
            "target_fingerprint": extractor.fingerprint, "hidden_size": str(extractor.hidden_size),
            "trace_ids": json.dumps([traces[i]["id"] for i in order])}
    tensors = {"input_ids": ids, "loss_mask": mask, "cu_seqlens": cu, "aux_hidden_states": aux, "last_hidden_states": last}
    info = {"tokens": int(ids.numel()), "sequences": len(order), "loss_tokens": int(mask.sum()),
            "aux_layer_ids": extractor.aux_layer_ids, "convention": VLLM, "target_fingerprint": extractor.fingerprint}
    # Streamed straight into the store (atomic there): one write of the bytes, no local temp copy.
    publish_shard(store, run, STAGE, plan.index, SUFFIX, spec, info, stream=SafetensorsStream(tensors, meta))
    return info


def _check_traces(traces: list[dict], plan: ShardPlan) -> None:
    for t in traces:
        if len(t["input_ids"]) != len(t["loss_mask"]):
            raise ConfigError(f"trace {t.get('id')!r} has {len(t['input_ids'])} input_ids but {len(t['loss_mask'])} "
                              "loss_mask values; regenerate the traces")


_EXTRACTORS: dict[tuple, HiddenStateExtractor] = {}


def _cached_extractor(target_dir: str, ids: tuple, device: str, dtype: str) -> HiddenStateExtractor:
    """One loaded target per process: a worker running shard after shard loads the weights once.
    The fingerprint in the key makes a changed checkpoint load anew."""
    key = (target_dir, ids, device, dtype, target_fingerprint(target_dir))
    if key not in _EXTRACTORS:
        _EXTRACTORS.clear()
        _EXTRACTORS[key] = HiddenStateExtractor(target_dir, list(ids) or None, device, dtype)
    return _EXTRACTORS[key]


class _Stage:
    """Shared state of one extraction stage: plan, trace checksums, the loaded extractor (on first need)."""

    def __init__(self, cfg: ExtractConfig, target_dir, store, run, dtype, model=None):
        self.cfg, self.target_dir, self.store, self.run, self.dtype = cfg, str(target_dir), store, run, dtype
        # Cheap checks first: bad layer ids fail before traces are read or weights loaded.
        validate_aux_layer_ids(cfg.aux_layer_ids, num_layers(self.target_dir))
        self.entries = {e.key: e for e in _trace_entries(store, run)}
        self.trace_sha = {k: e.sha256 for k, e in self.entries.items()}
        self.plans = plan_hidden_shards(cfg, store, run)
        if model is not None:
            self.extractor = HiddenStateExtractor(self.target_dir, cfg.aux_layer_ids, cfg.device, dtype, model=model)
        else:
            self.extractor = _cached_extractor(self.target_dir, tuple(cfg.aux_layer_ids or ()), cfg.device, dtype)

    def done(self, plan: ShardPlan):
        return finished_shard(self.store, self.run, STAGE, plan.index, _shard_spec(self.extractor, plan, self.trace_sha))


def extract_shard(cfg: ExtractConfig, target_dir: str | Path, store, run: str, shard_index: int,
                  dtype: str = "bfloat16", _stage: _Stage | None = None) -> dict:
    """Extract hidden-state shard `shard_index` of run `run` unless it is already published intact; returns its info."""
    stage = _stage or _Stage(cfg, target_dir, store, run, dtype)
    if not 0 <= shard_index < len(stage.plans):
        raise ConfigError(f"hidden-state shard {shard_index} does not exist; run {run!r} has {len(stage.plans)} shards")
    plan = stage.plans[shard_index]
    record = stage.done(plan)
    if record is not None:
        return {**record.metadata, "computed": False}
    traces = _load_shard_traces(store, plan, stage.entries)
    _check_traces(traces, plan)
    order, cu, aux, last = stage.extractor.extract([t["input_ids"] for t in traces], cfg.batch_tokens)
    spec = _shard_spec(stage.extractor, plan, stage.trace_sha)
    return {**_write_shard(store, run, plan, spec, stage.extractor, traces, order, cu, aux, last), "computed": True}


def finalize_hidden_states(store, run: str, num_shards: int) -> None:
    """Write `<run>/hidden/manifest.json` from every shard's completion record."""
    write_stage_manifest(store, run, STAGE, shard_records(store, run, STAGE, num_shards))


def run_overlapped(extractor: HiddenStateExtractor, jobs: Iterable, write: Callable, batch_tokens: int) -> list[int]:
    """Extract each (plan, traces) job and hand the result to `write` on a writer thread, so that shard k is
    serialized and uploaded while shard k+1 runs on the device. Returns the computed shard indices."""
    computed: list[int] = []
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftline-shard-writer")
    pending: Future | None = None
    try:
        for plan, traces in jobs:
            order, cu, aux, last = extractor.extract([t["input_ids"] for t in traces], batch_tokens)
            if pending is not None:
                pending.result()  # at most one shard in flight: bounded host memory
            pending = writer.submit(write, plan, traces, order, cu, aux, last)
            computed.append(plan.index)
        if pending is not None:
            pending.result()
    finally:
        writer.shutdown(wait=True)
    return computed


def extract_hidden_states(cfg: ExtractConfig, target_dir: str | Path, store, run: str, dtype: str = "bfloat16",
                          model=None) -> dict:
    """The whole stage: every unfinished shard (writes overlap the next shard's forward), then the manifest."""
    stage = _Stage(cfg, target_dir, store, run, dtype, model=model)
    t0 = time.perf_counter()

    def jobs():
        for plan in stage.plans:
            if stage.done(plan) is None:
                traces = _load_shard_traces(store, plan, stage.entries)
                _check_traces(traces, plan)
                yield plan, traces

    def write(plan, traces, order, cu, aux, last):
        spec = _shard_spec(stage.extractor, plan, stage.trace_sha)
        _write_shard(store, run, plan, spec, stage.extractor, traces, order, cu, aux, last)

    computed = run_overlapped(stage.extractor, jobs(), write, cfg.batch_tokens)
    tokens = sum(stage.plans[i].tokens for i in computed)
    finalize_hidden_states(store, run, len(stage.plans))
    elapsed = time.perf_counter() - t0
    return {"shards": len(stage.plans), "computed_shards": computed, "tokens_computed": tokens,
            "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
            "aux_layer_ids": stage.extractor.aux_layer_ids, "convention": VLLM,
            "target_fingerprint": stage.extractor.fingerprint}
