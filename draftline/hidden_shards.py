"""Hidden-state shards, whichever backend computes them: the plan that groups traces into shards, a shard in host
memory, its write to the store and the stage's manifest."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the extraction benchmark runs this module on GPU machines that have torch and transformers only
    from draftline.config import ExtractConfig
from draftline.aux_ids import VLLM
from draftline.errors import ConfigError
from draftline.layout import HIDDEN_STAGE, hidden_plan_key, traces_prefix
from draftline.safetensors_io import safetensors_chunks
from draftline.shards import publish_shard, shard_records, spec_hash, write_stage_manifest
from draftline.state_storage import BF16, FP8_E4M3, SCALE_SUFFIX

STAGE = HIDDEN_STAGE
SUFFIX = ".safetensors"
# What every shard's last_hidden_states hold, whichever backend made it: the final norm's output, what the
# lm_head reads (vLLM hands over the last layer's output before the norm; its backend applies the norm).
LAST_STATE = "final_norm_output"


# ---------------------------------------------------------------- planning

@dataclass(frozen=True)
class ShardPlan:
    """Which traces go into one hidden-state shard: (trace shard key, first line, end line) ranges, in order."""

    index: int
    ranges: list[tuple[str, int, int]]
    tokens: int
    sequences: int


def trace_entries(store, run: str):
    manifest = store.read_manifest(traces_prefix(run))
    if manifest is None:
        raise ConfigError(f"{store.uri(traces_prefix(run))} has no manifest.json; run trace generation for run {run!r} first")
    return [e for e in manifest if e.key.rsplit("/", 1)[-1].startswith("shard-") and e.key.endswith(".jsonl")]


def _read_traces(store, key: str, expect=None) -> list[dict]:
    return [json.loads(x) for x in store.get_bytes(key, expect=expect).decode("utf-8").splitlines() if x.strip()]


def plan_hidden_shards(cfg: ExtractConfig, store, run: str) -> list[ShardPlan]:
    """Group traces, in order, into shards of about cfg.tokens_per_shard tokens; cached in `<run>/hidden/_plan.json`."""
    entries = trace_entries(store, run)
    basis = spec_hash({"traces": [(e.key, e.sha256) for e in entries], "tokens_per_shard": cfg.tokens_per_shard})
    plan_key = hidden_plan_key(run)
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



# ---------------------------------------------------------------- a shard in host memory

class HostBufferPool:
    """Reusable host buffers for batch results, at most `limit` handed out at once (acquire blocks: backpressure).

    Pinned on CUDA: only pinned memory takes a device→host copy at full speed, and pinning is slow, so buffers are
    kept and reused rather than freed.
    """

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.limit: int | None = None
        self._free: list[torch.Tensor] = []
        self._handed_out = 0
        self._changed = threading.Condition()

    def acquire(self, nbytes: int, min_bytes: int = 0) -> torch.Tensor:
        """A flat uint8 buffer of at least nbytes (a new one gets max(nbytes, min_bytes)); blocks at the limit."""
        with self._changed:
            self._changed.wait_for(lambda: self.limit is None or self._handed_out < self.limit)
            self._handed_out += 1
            # Indices, not list.remove: tensors compare elementwise.
            by_size = sorted(range(len(self._free)), key=lambda i: self._free[i].numel())
            fitting = [i for i in by_size if self._free[i].numel() >= nbytes]
            if fitting:
                return self._free.pop(fitting[0])
            if self._free:  # too small for this batch: replace one rather than grow the pool
                self._free.pop(by_size[0])
        try:
            return torch.empty(max(nbytes, min_bytes), dtype=torch.uint8, pin_memory=self.pinned)
        except BaseException:
            self.release(None)
            raise

    def release(self, buf: torch.Tensor | None) -> None:
        with self._changed:
            if buf is not None:
                self._free.append(buf)
            self._handed_out -= 1
            self._changed.notify_all()


@dataclass
class HostShard:
    """One shard's hidden states in host memory, as per-batch row blocks whose concatenation is the shard's tensor.

    `order` is the longest-first sequence order the shard keeps; on CUDA the blocks are filled asynchronously,
    so readers call wait() first, and release() hands the buffers back to the pool once the shard is written.
    """

    order: list[int]
    cu_seqlens: torch.Tensor
    aux_blocks: list[torch.Tensor]
    last_blocks: list[torch.Tensor]
    copied: torch.cuda.Event | None = None
    buffers: list[torch.Tensor] = field(default_factory=list)
    pool: HostBufferPool | None = None
    # fp8-e4m3: the state blocks are e4m3 and these hold their float32 scales ([n, 3] and [n, 1] per block).
    storage: str = BF16
    aux_scale_blocks: list[torch.Tensor] = field(default_factory=list)
    last_scale_blocks: list[torch.Tensor] = field(default_factory=list)

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()

    def aux(self) -> torch.Tensor:
        self.wait()
        return torch.cat(self.aux_blocks)

    def last(self) -> torch.Tensor:
        self.wait()
        return torch.cat(self.last_blocks)

    def release(self) -> None:
        self.wait()  # a pending copy must not land in a buffer that is already reused
        buffers, self.buffers = self.buffers, []
        for buf in buffers:
            self.pool.release(buf)


# ---------------------------------------------------------------- writing shards

def shard_spec(source, plan: ShardPlan, trace_sha: dict[str, str]) -> str:
    """What determines a shard's content: target, layers, dtype, the traces, and the backend and the state storage
    when they are not the default (so switching either recomputes, while shards made before they existed stay valid)."""
    spec = {"target": source.fingerprint, "aux": source.aux_layer_ids, "dtype": source.dtype,
            "ranges": [(k, trace_sha[k], a, b) for k, a, b in plan.ranges]}
    if source.backend != "transformers":
        spec["backend"] = source.backend
    if source.storage != BF16:
        spec["storage"] = source.storage
    return spec_hash(spec)


def load_shard_traces(store, plan: ShardPlan, entries) -> list[dict]:
    out, cache = [], {}
    for key, a, b in plan.ranges:
        if key not in cache:
            cache = {key: _read_traces(store, key, expect=entries.get(key))}
        out.extend(cache[key][a:b])
    return out


def write_hidden_shard(store, run: str, plan: ShardPlan, spec: str, source, traces: list[dict],
                       host: HostShard, stage: str = STAGE) -> dict:
    """Write one shard (contract D) into the store straight from the host buffers, then its completion record.

    `source` (a HiddenStateExtractor or the vLLM backend's capture) names the layers, target and backend."""
    order = host.order
    ids = torch.tensor([t for i in order for t in traces[i]["input_ids"]], dtype=torch.int64)
    mask = torch.tensor([m for i in order for m in traces[i]["loss_mask"]], dtype=torch.uint8)
    meta = {"aux_layer_ids": json.dumps(source.aux_layer_ids), "convention": VLLM,
            "target_fingerprint": source.fingerprint, "hidden_size": str(source.hidden_size),
            "trace_ids": json.dumps([traces[i]["id"] for i in order]),
            "last_hidden_state": LAST_STATE, "backend": source.backend, "storage": host.storage}
    host.wait()
    tensors = {"input_ids": ids, "loss_mask": mask, "cu_seqlens": host.cu_seqlens,
               "aux_hidden_states": host.aux_blocks, "last_hidden_states": host.last_blocks}
    if host.storage == FP8_E4M3:
        tensors["aux_hidden_states" + SCALE_SUFFIX] = host.aux_scale_blocks
        tensors["last_hidden_states" + SCALE_SUFFIX] = host.last_scale_blocks
    info = {"tokens": int(ids.numel()), "sequences": len(order), "loss_tokens": int(mask.sum()),
            "aux_layer_ids": source.aux_layer_ids, "convention": VLLM, "target_fingerprint": source.fingerprint,
            "backend": source.backend, "storage": host.storage}
    publish_shard(store, run, stage, plan.index, SUFFIX, spec, info, chunks=safetensors_chunks(tensors, meta))
    return info


def check_traces(traces: list[dict], plan: ShardPlan) -> None:
    for t in traces:
        if len(t["input_ids"]) != len(t["loss_mask"]):
            raise ConfigError(f"trace {t.get('id')!r} has {len(t['input_ids'])} input_ids but {len(t['loss_mask'])} "
                              "loss_mask values; regenerate the traces")


def finalize_hidden_states(store, run: str, num_shards: int, stage: str = STAGE) -> None:
    """Write `<run>/hidden/manifest.json` (`<run>/<stage>/`) from every shard's completion record."""
    write_stage_manifest(store, run, stage, shard_records(store, run, stage, num_shards))
