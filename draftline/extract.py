"""Traces → hidden-state shards: one hooked forward per length-bucketed batch, bf16 (or fp8 + scales) capture,
overlapped copies and writes."""
from __future__ import annotations

import collections
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import torch

if TYPE_CHECKING:  # the benchmark runs this module on GPU machines that have torch and transformers only
    from draftline.config import ExtractConfig
from draftline.aux_ids import VLLM, AuxLayerIds
from draftline.errors import ConfigError, ShardWriteError, is_transient
from draftline.hidden_shards import (
    STAGE, HostBufferPool, HostShard, ShardPlan, check_traces, finalize_hidden_states, length_buckets,
    load_shard_traces, plan_hidden_shards, shard_spec, trace_entries, write_hidden_shard,
)
from draftline.shards import finished_shard
from draftline.state_storage import BF16, FP8_DTYPE, FP8_E4M3, bytes_per_token, quantize_rows
from draftline.target import (
    capture_hidden_states, decoder_model, load_target, num_layers, read_target_config, resolve_device,
    target_fingerprint,
)


# ---------------------------------------------------------------- the extractor

def state_views(buf: torch.Tensor, n: int, h: int, storage: str):
    """(aux [n, 3h], last [n, h], aux scales [n, 3] or None, last scales [n, 1] or None) laid out in the flat uint8
    buffer `buf`: the states first, then (fp8) their float32 scales, so one copy moves a whole batch."""
    if storage == BF16:
        states = buf[: n * 8 * h].view(torch.bfloat16)
        return states[: n * 3 * h].view(n, 3 * h), states[n * 3 * h:].view(n, h), None, None
    states = buf[: n * 4 * h].view(FP8_DTYPE)
    scales = buf[n * 4 * h: n * (4 * h + 16)].view(torch.float32)  # n * 4h bytes in: 4-byte aligned
    return (states[: n * 3 * h].view(n, 3 * h), states[n * 3 * h:].view(n, h), scales[: 3 * n].view(n, 3),
            scales[3 * n:].view(n, 1))


class HiddenStateExtractor:
    """Holds a loaded target with hooks on the aux layers and the final norm; turns token sequences into host tensors.

    Each batch: one forward of the decoder stack (no lm_head), the hooks gather the real (unpadded) tokens of each
    captured tensor into a device staging buffer (bf16, or with storage fp8-e4m3 quantized there, on the device, with
    one scale per token and state), and one contiguous copy moves it into the batch's own contiguous pinned host
    buffer on a side stream, so the next batch computes while it copies.
    """

    def __init__(self, target_dir: str | Path | None, aux_layer_ids: list[int] | None = None, device: str = "auto",
                 dtype: str = "bfloat16", model=None, storage: str = BF16):
        self.target_dir = str(target_dir) if target_dir is not None else None
        if self.target_dir is None and model is None:
            raise ConfigError("HiddenStateExtractor needs a target directory or a loaded model; pass target_dir")
        # Validate ids against the config before loading any weights.
        depth = num_layers(read_target_config(self.target_dir)) if self.target_dir else num_layers(model)
        self.aux_layer_ids = AuxLayerIds.for_target(aux_layer_ids, depth).as_list()
        self.device = torch.device(resolve_device(device, "extract.device"))
        self.model = model if model is not None else load_target(self.target_dir, dtype, self.device)[0]
        self.decoder = decoder_model(self.model)
        self.hidden_size = int(self.model.config.get_text_config().hidden_size)
        # A model handed over in memory (benchmarks) has no files to hash.
        self.fingerprint = target_fingerprint(self.target_dir) if self.target_dir else "in-memory"
        self.dtype = str(self.model.dtype)
        self.backend = "transformers"
        bytes_per_token(1, storage)  # refuses an unknown storage before any batch
        self.storage = storage
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._staging: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self.host_pool = HostBufferPool(pinned=self._cuda)
        # Batches issued to the device and not finished, at most max_queued_batches (see _pace).
        self.max_queued_batches = 2
        self._queued: collections.deque[torch.cuda.Event] = collections.deque()

    @property
    def bytes_per_token(self) -> int:
        """Host bytes of one token's states: 3 aux + the last hidden state, bf16 or fp8 with their scales."""
        return bytes_per_token(self.hidden_size, self.storage)

    def _stage(self, slot: int, nbytes: int) -> torch.Tensor:
        """A flat device staging buffer of `nbytes`, two slots used alternately (reuse waits for that slot's copy)."""
        while len(self._staging) <= slot:
            self._staging.append((torch.empty(0, dtype=torch.uint8), None))
        buf, event = self._staging[slot]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        if buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._staging[slot] = (buf, None)
        return buf[:nbytes]

    def extract(self, sequences: list[list[int]], batch_tokens: int, shard: int | None = None) -> HostShard:
        """Run the length-bucketed batches of `sequences`; the result's blocks stay valid until its release()."""
        lengths = [len(s) for s in sequences]
        batches = length_buckets(lengths, batch_tokens)
        limit = self.host_pool.limit
        if limit is not None and len(batches) > limit:
            where = f"shard {shard}" if shard is not None else "this shard"
            raise ConfigError(f"{where} needs {len(batches)} batches but extract.max_batches_in_flight={limit}; "
                              f"raise it to at least {len(batches)} or lower extract.tokens_per_shard")
        order = [i for batch in batches for i in batch]
        cu = [0]
        for i in order:
            cu.append(cu[-1] + lengths[i])
        host = HostShard(order, torch.tensor(cu, dtype=torch.int64), [], [], pool=self.host_pool, storage=self.storage)
        try:
            for batch in batches:
                self._extract_batch(sequences, batch, host, batch_tokens)
        except BaseException:
            host.release()
            raise
        if self._cuda:
            host.copied = torch.cuda.Event()
            host.copied.record(self._copy_stream)  # the copy stream runs in order: this covers every block
        return host

    def _pace(self) -> None:
        """Wait, without the GIL, until fewer than max_queued_batches batches are queued on the device.

        Unpaced, this thread runs ahead of the device until CUDA's launch queue is full and then blocks inside a
        kernel launch while holding the GIL, which starves the shard writers (their hashing and writes need it
        between buffers). An event wait releases the GIL, and one batch queued keeps the device busy meanwhile.
        """
        while len(self._queued) >= self.max_queued_batches:
            self._queued.popleft().synchronize()

    @torch.inference_mode()
    def _extract_batch(self, sequences: list[list[int]], batch: list[int], host: HostShard, batch_tokens: int) -> None:
        if self._cuda:
            self._pace()
        h = self.hidden_size
        lengths = [len(sequences[i]) for i in batch]
        width, n_tok = max(lengths), sum(lengths)
        nbytes = n_tok * self.bytes_per_token
        buf = self.host_pool.acquire(nbytes, min_bytes=batch_tokens * self.bytes_per_token)
        host.buffers.append(buf)
        host_buf = buf[:nbytes]
        host_aux, host_last, host_aux_scale, host_last_scale = state_views(host_buf, n_tok, h, self.storage)
        host.aux_blocks.append(host_aux)
        host.last_blocks.append(host_last)
        if self.storage == FP8_E4M3:
            host.aux_scale_blocks.append(host_aux_scale)
            host.last_scale_blocks.append(host_last_scale)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : lengths[row]] = torch.tensor(sequences[i], dtype=torch.long)
        # Flat positions of real tokens, row by row; right padding + causal attention leaves them unaffected.
        flat = torch.cat([torch.arange(row * width, row * width + n) for row, n in enumerate(lengths)])
        slot = len(host.aux_blocks) % 2
        if self._cuda:
            stage_buf = self._stage(slot, nbytes)
            ids = ids.pin_memory().to(self.device, non_blocking=True)
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        else:  # on CPU the hooks write straight into the host buffer: no staging, no copy
            stage_buf = host_buf
        stage_aux, stage_last, stage_aux_scale, stage_last_scale = state_views(stage_buf, n_tok, h, self.storage)
        slots = {"aux0": 0, "aux1": 1, "aux2": 2}

        def sink(name, hidden):
            rows = hidden.reshape(-1, h).index_select(0, flat)
            if name == "last":
                out, scale_out = stage_last, stage_last_scale
            else:
                s = slots[name]
                out = stage_aux[:, s * h:(s + 1) * h]
                scale_out = stage_aux_scale[:, s:s + 1] if stage_aux_scale is not None else None
            if scale_out is None:
                out.copy_(rows)
            else:
                quantize_rows(rows, out=out, scale_out=scale_out)

        with capture_hidden_states(self.model, self.aux_layer_ids, sink):
            self.decoder(input_ids=ids, use_cache=False)
        if self._cuda:
            issued = torch.cuda.Event()
            issued.record(torch.cuda.current_stream(self.device))
            self._queued.append(issued)
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                # The whole contiguous batch into contiguous pinned memory: one DMA, at full bandwidth.
                host_buf.copy_(stage_buf, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            self._staging[slot] = (self._staging[slot][0], event)



_EXTRACTORS: dict[tuple, HiddenStateExtractor] = {}


def _cached_extractor(target_dir: str, ids: tuple, device: str, dtype: str, storage: str) -> HiddenStateExtractor:
    """One loaded target per process: a worker running shard after shard loads the weights once.
    The fingerprint in the key makes a changed checkpoint load anew."""
    key = (target_dir, ids, device, dtype, target_fingerprint(target_dir))
    if key not in _EXTRACTORS:
        _EXTRACTORS.clear()
        _EXTRACTORS[key] = HiddenStateExtractor(target_dir, list(ids) or None, device, dtype)
    extractor = _EXTRACTORS[key]
    extractor.storage = storage  # the same weights serve either storage; one stage runs at a time per process
    return extractor


class _Stage:
    """Shared state of one extraction stage: plan, trace checksums, the loaded extractor (on first need)."""

    def __init__(self, cfg: ExtractConfig, target_dir, store, run, dtype, model=None):
        self.cfg, self.target_dir, self.store, self.run, self.dtype = cfg, str(target_dir), store, run, dtype
        # Cheap checks first: bad layer ids fail before traces are read or weights loaded.
        AuxLayerIds.for_target(cfg.aux_layer_ids, num_layers(self.target_dir))
        self.entries = {e.key: e for e in trace_entries(store, run)}
        self.trace_sha = {k: e.sha256 for k, e in self.entries.items()}
        self.plans = plan_hidden_shards(cfg, store, run)
        if model is not None:
            self.extractor = HiddenStateExtractor(self.target_dir, cfg.aux_layer_ids, cfg.device, dtype, model=model,
                                                  storage=cfg.storage)
        else:
            self.extractor = _cached_extractor(self.target_dir, tuple(cfg.aux_layer_ids or ()), cfg.device, dtype,
                                               cfg.storage)

    def done(self, plan: ShardPlan):
        return finished_shard(self.store, self.run, STAGE, plan.index, shard_spec(self.extractor, plan, self.trace_sha))


def extract_shard(cfg: ExtractConfig, target_dir: str | Path, store, run: str, shard_index: int,
                  dtype: str = "bfloat16", _stage: _Stage | None = None) -> dict:
    """Extract hidden-state shard `shard_index` of run `run` unless it is already published intact; returns its info."""
    if cfg.backend != "transformers":
        raise ConfigError(f"extract.backend={cfg.backend!r} extracts a whole stage through one engine server; call "
                          "extract_hidden_states, not extract_shard")
    stage = _stage or _Stage(cfg, target_dir, store, run, dtype)
    if not 0 <= shard_index < len(stage.plans):
        raise ConfigError(f"hidden-state shard {shard_index} does not exist; run {run!r} has {len(stage.plans)} shards")
    plan = stage.plans[shard_index]
    record = stage.done(plan)
    if record is not None:
        return {**record.metadata, "computed": False}
    traces = load_shard_traces(store, plan, stage.entries)
    check_traces(traces, plan)
    host = stage.extractor.extract([t["input_ids"] for t in traces], cfg.batch_tokens, shard=plan.index)
    try:
        spec = shard_spec(stage.extractor, plan, stage.trace_sha)
        return {**write_hidden_shard(store, run, plan, spec, stage.extractor, traces, host), "computed": True}
    finally:
        host.release()



def run_overlapped(extractor: HiddenStateExtractor, jobs: Iterable, write: Callable, batch_tokens: int,
                   writer_threads: int = 3, max_batches_in_flight: int | None = None) -> list[int]:
    """Extract each (plan, traces) job and hand its HostShard to `write(plan, traces, host)` on a pool of writer
    threads, so shards are serialized and fsync'd side by side while the next one runs on the device.

    Backpressure bounds host memory: a computed shard waits until fewer than `writer_threads` shards are queued or
    being written, and at most `max_batches_in_flight` batch buffers exist (None: no limit but the shard one).
    A failed write stops the stage and is raised as a ShardWriteError naming the shard, once the other writers
    have finished. Returns the indices of the shards computed and written.
    """
    if writer_threads < 1:
        raise ConfigError(f"extract.writer_threads={writer_threads}; use at least 1")
    extractor.host_pool.limit = max_batches_in_flight
    writers = ThreadPoolExecutor(max_workers=writer_threads, thread_name_prefix="draftline-shard-writer")
    pending: dict[Future, int] = {}
    failures: list[tuple[int, BaseException]] = []
    computed: list[int] = []

    def write_then_release(plan, traces, host):
        try:
            write(plan, traces, host)
        except BaseException as exc:
            raise ShardWriteError(
                f"hidden-state shard {plan.index} was not written ({type(exc).__name__}: {exc}); it has no completion "
                "record, so a rerun computes it again", transient=is_transient(exc)) from exc
        finally:
            host.release()

    def collect(done) -> None:
        for future in done:
            index = pending.pop(future)
            if future.exception() is not None:
                failures.append((index, future.exception()))

    try:
        for plan, traces in jobs:
            collect([f for f in pending if f.done()])
            if failures:
                break  # stop computing: the stage fails anyway
            host = extractor.extract([t["input_ids"] for t in traces], batch_tokens, shard=plan.index)
            try:
                while len(pending) >= writer_threads:
                    collect(wait(pending, return_when=FIRST_COMPLETED).done)
                pending[writers.submit(write_then_release, plan, traces, host)] = plan.index
            except BaseException:
                host.release()
                raise
            computed.append(plan.index)
        collect(wait(pending).done)
    finally:
        writers.shutdown(wait=True, cancel_futures=True)
        extractor.host_pool.limit = None
    if failures:
        raise min(failures, key=lambda f: f[0])[1]
    return computed


def extract_hidden_states(cfg: ExtractConfig, target_dir: str | Path, store, run: str, dtype: str = "bfloat16",
                          model=None) -> dict:
    """The whole stage: every unfinished shard (writes overlap the next shard's forward), then the manifest.

    With extract.backend vllm the target runs in a supervised vLLM server instead (draftline.extract_vllm)."""
    if cfg.backend == "vllm":
        from draftline.extract_vllm import extract_with_vllm

        return extract_with_vllm(cfg, target_dir, store, run, dtype)
    stage = _Stage(cfg, target_dir, store, run, dtype, model=model)
    t0 = time.perf_counter()

    def jobs():
        for plan in stage.plans:
            if stage.done(plan) is None:
                traces = load_shard_traces(store, plan, stage.entries)
                check_traces(traces, plan)
                yield plan, traces

    def write(plan, traces, host):
        spec = shard_spec(stage.extractor, plan, stage.trace_sha)
        write_hidden_shard(store, run, plan, spec, stage.extractor, traces, host)

    computed = run_overlapped(stage.extractor, jobs(), write, cfg.batch_tokens, writer_threads=cfg.writer_threads,
                              max_batches_in_flight=cfg.max_batches_in_flight)
    tokens = sum(stage.plans[i].tokens for i in computed)
    finalize_hidden_states(store, run, len(stage.plans))
    elapsed = time.perf_counter() - t0
    return {"shards": len(stage.plans), "computed_shards": computed, "tokens_computed": tokens,
            "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
            "aux_layer_ids": stage.extractor.aux_layer_ids, "convention": VLLM,
            "target_fingerprint": stage.extractor.fingerprint, "backend": "transformers",
            "storage": stage.extractor.storage}
