"""Hidden-state extraction through a vLLM server (extract.backend: vllm): vLLM runs the target with its own
parallelism and kernels, its extract_hidden_states method captures the layers, draftline's connector spools
them (already normed and, for fp8-e4m3, quantized on the device), and this module assembles shards in the same format,
order and store layout as the transformers backend."""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import torch

from draftline.aux_ids import VLLM, AuxLayerIds
from draftline.config import ExtractConfig, ServerSettings
from draftline.engines.parallel import devices_needed
from draftline.errors import ConfigError, EngineError
from draftline.hidden_shards import (
    STAGE, HostShard, check_traces, load_shard_traces, trace_entries, finalize_hidden_states,
    length_buckets, plan_hidden_shards, shard_spec, write_hidden_shard,
)
from draftline.images import media_placeholder_id
from draftline.layout import hidden_logs_prefix, this_start
from draftline.shards import finished_shard
from draftline.safetensors_io import map_safetensors
from draftline.served_context import LONGER_CONTEXT_ENV, context_lifted, engine_context
from draftline.state_storage import BF16, FP8_E4M3, SCALE_SUFFIX, STATE_NAMES
from draftline.target import final_norm_params, num_layers, read_target_config, target_fingerprint

BACKEND = "vllm"
# How long a finished request's spooled file may take to appear: the connector writes it after the response.
SPOOL_WAIT_S = 120.0


@dataclass
class CapturedTarget:
    """What a shard records about its source when vLLM captured it (the transformers backend's extractor has the same)."""

    fingerprint: str
    aux_layer_ids: list[int]
    hidden_size: int
    dtype: str
    backend: str = BACKEND
    storage: str = BF16


# ---------------------------------------------------------------- preflight

def check_devices(settings: ServerSettings, field: str, visible: int | None = None) -> None:
    """Refuse parallel sizes that need more GPUs than this worker sees (on a machine without GPUs vLLM's CPU build
    runs its ranks as processes, so nothing is checked there)."""
    visible = torch.cuda.device_count() if visible is None else visible
    needed = devices_needed(settings)
    if visible and needed > visible:
        raise ConfigError(f"{field} asks for {needed} GPUs (tensor x pipeline x data parallel) but this worker sees "
                          f"{visible}; lower {field}.tensor_parallel_size or run the stage on a worker with {needed}")


def check_architecture(target_dir: str | Path, settings: ServerSettings | None = None) -> str:
    """Ask vLLM's model registry (preflight's lookup; in the engine's own environment when settings name one) whether
    the target's class can hand over aux hidden states; returns the architecture, or raises one sentence naming the fix."""
    from draftline.engines.preflight import probe_environment, runs_elsewhere, target_architecture
    from draftline.engines.registry import vllm_supports_eagle3

    arch = target_architecture(Path(target_dir))
    try:
        if settings is not None and runs_elsewhere(settings):
            facts = probe_environment(settings, "vllm", arch)
            if facts["version"] is None:
                raise ImportError("vllm")
            supported = facts["supported"]
        else:
            supported = vllm_supports_eagle3(arch)
    except ImportError:
        raise ConfigError("extract.backend is vllm but vllm is not installed in this environment; run the stage on a "
                          "worker of the engine's pool (gpu-vllm) or use extract.backend: transformers") from None
    if supported is None:
        raise ConfigError(f"target architecture {arch!r} is not in this vLLM's model registry; use "
                          "extract.backend: transformers or a vLLM that serves it")
    if not supported:
        raise ConfigError(f"vLLM's {arch} does not implement SupportsEagle3, so it cannot hand over aux hidden "
                          "states; use extract.backend: transformers for this target")
    return arch


# ---------------------------------------------------------------- requests

def write_final_norm(target_dir: str | Path, folder: Path) -> Path:
    """The target's final norm (weight and eps) in a file the capture connector loads onto its device."""
    from safetensors.torch import save_file

    weight, eps = final_norm_params(target_dir)
    path = folder / "final-norm.safetensors"
    save_file({"weight": weight.contiguous(), "eps": torch.tensor(eps, dtype=torch.float64)}, str(path))
    return path


def collapse_runs(token_ids: list[int], token: int | None) -> list[int]:
    """The ids with every run of `token` cut to one."""
    return [t for i, t in enumerate(token_ids) if t != token or i == 0 or token_ids[i - 1] != token]


class SpoolClient:
    """Sends one completion per sequence (max_tokens 1, tagged with a spool key and the storage) and maps what the
    connector spooled for it."""

    def __init__(self, base_url: str, spool_dir: Path, served_name: str = "target", workers: int = 64,
                 wait_s: float = SPOOL_WAIT_S, storage: str = BF16, media_placeholder: int | None = None):
        self.base_url, self.spool_dir, self.served_name, self.wait_s = base_url, spool_dir, served_name, wait_s
        self.storage, self.media_placeholder = storage, media_placeholder
        # A connection per request: a capture request is a whole trace's forward, so a connect costs nothing, and a
        # kept-alive connection the server closes while a starved client still reuses it drops the request.
        self.http = httpx.Client(timeout=600.0, limits=httpx.Limits(max_connections=workers,
                                                                    max_keepalive_connections=0))
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="draftline-capture")

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.http.close()

    def submit(self, key: str, token_ids: list[int], images: list[str] | None = None) -> Future:
        return self.pool.submit(self.capture, key, token_ids, images)

    def request(self, key: str, token_ids: list[int], images: list[str] | None = None) -> None:
        """One capture request; returns once vLLM has answered it (its connector writes the file just after).
        images: the trace's image URLs; its ids already hold the media tokens vLLM expanded when it answered, so
        the ids go to vLLM's token-in endpoint with the images, and the vision tower fills those positions again."""
        from draftline.engines.capture_keys import KEY_PARAM, STORAGE_PARAM

        transfer = {KEY_PARAM: key, STORAGE_PARAM: self.storage}
        if images:
            # vLLM expands each image's one placeholder into as many as the image has features, as it did when it
            # answered the prompt: the trace's runs of placeholders go back as one each.
            url = f"{self.base_url}/inference/v1/generate"
            body = {"model": self.served_name, "token_ids": collapse_runs(token_ids, self.media_placeholder),
                    "kv_transfer_params": transfer,
                    "content_parts": [{"type": "image_url", "url": u} for u in images],
                    "sampling_params": {"max_tokens": 1, "temperature": 0.0}}
        else:
            url = f"{self.base_url}/v1/completions"
            body = {"model": self.served_name, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0,
                    "kv_transfer_params": transfer}
        try:
            resp = self.http.post(url, json=body)
        except httpx.HTTPError as exc:  # the server died or hung mid-stage: a restart may get further
            raise EngineError(f"vLLM stopped answering capture request {key} ({type(exc).__name__}: {exc}); "
                              "finished work is kept and a rerun resumes after it", transient=True) from exc
        if resp.status_code != 200:
            raise EngineError(f"vLLM refused capture request {key} with HTTP {resp.status_code}: {resp.text[:300]}",
                              transient=resp.status_code >= 500)

    def capture(self, key: str, token_ids: list[int], images: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The shard rows of `token_ids` as vLLM computed them (aux [n, 3h], the normed last state [n, h], and
        their scales for fp8-e4m3), as views of the spooled file, which is already removed."""
        from draftline.engines.capture_keys import error_path, spool_path

        self.request(key, token_ids, images)
        path = spool_path(str(self.spool_dir), key)
        deadline = time.monotonic() + self.wait_s
        while not os.path.exists(path):
            if os.path.exists(error_path(path)):
                raise EngineError(f"vLLM's capture connector could not write {path}: {Path(error_path(path)).read_text()}")
            if time.monotonic() > deadline:
                raise EngineError(f"vLLM answered capture request {key} but its states never reached {path} within "
                                  f"{self.wait_s:.0f} s; is the server running draftline's connector "
                                  "(kv_connector_module_path draftline.engines.vllm_capture)?", transient=True)
            time.sleep(0.01)
        data, meta = map_safetensors(path)
        os.remove(path)  # the map keeps the pages until the shard is written
        if data["token_ids"].tolist() != list(token_ids):
            raise EngineError(f"vLLM's states for capture request {key} belong to other tokens; the spool folder "
                              f"{self.spool_dir} is shared with another run")
        expected = list(STATE_NAMES) + ([n + SCALE_SUFFIX for n in STATE_NAMES] if self.storage == FP8_E4M3 else [])
        if meta.get("storage") != self.storage or any(n not in data for n in expected):
            raise EngineError(f"vLLM's capture connector spooled {sorted(data)} in storage {meta.get('storage')!r} for "
                              f"request {key}, not {self.storage!r} shard rows; the server runs a connector other "
                              "than this draftline's (kv_connector_module_path draftline.engines.vllm_capture)")
        return {n: data[n] for n in expected}


# ---------------------------------------------------------------- the stage

def _max_model_len(settings: ServerSettings, longest: int, target_dir: str) -> int:
    """Room for the longest trace plus the one token each request generates."""
    needed = longest + 1
    if settings.max_model_len is not None:
        if settings.max_model_len < needed:
            raise ConfigError(f"extract.vllm.max_model_len={settings.max_model_len} but the longest trace has {longest} "
                              f"tokens; raise it to at least {needed} or leave it unset")
        return settings.max_model_len
    context = engine_context(read_target_config(target_dir), "vllm")
    if context and needed > context[0] and not context_lifted(settings):
        limit, source = context
        raise ConfigError(f"the longest trace has {longest} tokens and extraction asks one more, past the {limit} "
                          f"tokens vLLM serves the target at (its {source}); make the traces again with "
                          f"traces.max_total_tokens {limit - 1} or less (or set {LONGER_CONTEXT_ENV['vllm']}=1 in "
                          "extract.vllm.env if the target is known to read further)")
    return needed


def _spool_root(cfg: ExtractConfig) -> Path:
    if cfg.spool_dir:
        return Path(cfg.spool_dir)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def assemble_shard(rows: list[dict[str, torch.Tensor]], order: list[int], storage: str = BF16) -> HostShard:
    """Per-sequence shard rows as the connector spooled them → a HostShard in `order`: the blocks are the spooled
    tensors themselves, so the shard writer reads each token once."""
    aux, last = [rows[i]["aux_hidden_states"] for i in order], [rows[i]["last_hidden_states"] for i in order]
    cu = torch.tensor([0] + [b.shape[0] for b in aux], dtype=torch.int64).cumsum(0)
    host = HostShard(order, cu, aux, last, storage=storage)
    if storage == FP8_E4M3:
        host.aux_scale_blocks = [rows[i]["aux_hidden_states" + SCALE_SUFFIX] for i in order]
        host.last_scale_blocks = [rows[i]["last_hidden_states" + SCALE_SUFFIX] for i in order]
    return host


def extract_with_vllm(cfg: ExtractConfig, target_dir: str | Path, store, run: str, dtype: str = "bfloat16",
                      log_dir: str | Path | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """The whole stage through one supervised vLLM server: every unfinished shard, then the manifest."""
    target_dir = str(target_dir)
    say = progress or (lambda msg: None)
    depth = num_layers(target_dir)
    aux_ids = AuxLayerIds.for_target(cfg.aux_layer_ids, depth).as_list()
    check_devices(cfg.vllm, "extract.vllm")
    text = read_target_config(target_dir)
    settings = cfg.vllm.resolved(dtype)
    source = CapturedTarget(target_fingerprint(target_dir), aux_ids, int(text.get("text_config", text)["hidden_size"]),
                            f"torch.{settings.dtype}", storage=cfg.storage)
    entries = {e.key: e for e in trace_entries(store, run)}
    trace_sha = {k: e.sha256 for k, e in entries.items()}
    plans = plan_hidden_shards(cfg, store, run)
    pending = [p for p in plans if finished_shard(store, run, STAGE, p.index, shard_spec(source, p, trace_sha)) is None]
    t0 = time.perf_counter()
    timing: dict = {}
    if pending:
        check_architecture(target_dir, settings)
        jobs = []
        for plan in pending:
            traces = load_shard_traces(store, plan, entries)
            check_traces(traces, plan)
            jobs.append((plan, traces))
        longest = max(len(t["input_ids"]) for _, traces in jobs for t in traces)
        _run_server(settings, target_dir, aux_ids + [depth], _max_model_len(settings, longest, target_dir), cfg,
                    store, run, source, trace_sha, jobs, log_dir, say, timing)
    finalize_hidden_states(store, run, len(plans))
    elapsed = time.perf_counter() - t0
    tokens = sum(p.tokens for p in pending)
    # tokens_per_s counts the capture alone (first request to last shard written); the engine start is apart.
    capture = timing.get("capture_s")
    return {"shards": len(plans), "computed_shards": [p.index for p in pending], "tokens_computed": tokens,
            "seconds": round(elapsed, 3), **timing,
            "tokens_per_s": round(tokens / capture, 1) if capture else None,
            "aux_layer_ids": aux_ids, "convention": VLLM, "target_fingerprint": source.fingerprint, "backend": BACKEND,
            "storage": source.storage}


def _run_server(settings, target_dir, layer_ids, max_model_len, cfg, store, run, source, trace_sha, jobs,
                log_dir, say, timing: dict) -> None:
    from draftline.engines.launch import launch
    from draftline.engines.vllm import capture_server_spec

    spool = Path(tempfile.mkdtemp(prefix=f"draftline-spool-{re.sub(r'[^A-Za-z0-9_.-]', '_', run)}-",
                                  dir=_spool_root(cfg)))
    # The server's log goes to the store (<run>/hidden/logs/<UTC start time>/); the local copy lives as long as the
    # stage.
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="draftline-capture-logs-"))
    try:
        media = any(t.get("images") for _, traces in jobs for t in traces)
        spec = capture_server_spec(settings, Path(target_dir), layer_ids, spool, max_model_len,
                                   write_final_norm(target_dir, spool), token_in=media)
        say(f"starting vLLM to capture layers {layer_ids} of {target_dir} (tensor parallel {settings.tensor_parallel_size})")
        started = time.perf_counter()
        with launch(spec, settings, logs, store=store, log_key_prefix=this_start(hidden_logs_prefix(run))) as server:
            timing["engine_start_s"] = round(time.perf_counter() - started, 3)
            say(f"vLLM ready after {timing['engine_start_s']:.0f} s")
            client = SpoolClient(server.base_url, spool, workers=cfg.requests_in_flight, storage=source.storage,
                                 media_placeholder=media_placeholder_id(target_dir))
            started = time.perf_counter()
            try:
                _capture_shards(client, jobs, cfg, store, run, source, trace_sha, say)
            finally:
                client.close()
            timing["capture_s"] = round(time.perf_counter() - started, 3)
    finally:
        shutil.rmtree(spool, ignore_errors=True)
        if not log_dir:
            shutil.rmtree(logs, ignore_errors=True)


def _capture_shards(client: SpoolClient, jobs, cfg, store, run, source, trace_sha, say) -> None:
    """Requests of the coming shards run in the server while earlier shards are assembled and written by
    extract.writer_threads writers (several fsync'd files at once keep the disk busier than one)."""

    def submit(i):
        plan, traces = jobs[i]
        return [client.submit(f"s{plan.index:05d}-{j:06d}", t["input_ids"], t.get("images")) for j, t in enumerate(traces)], \
            time.perf_counter()

    def write(plan, traces, states, t0):
        lengths = [len(t["input_ids"]) for t in traces]
        order = [k for batch in length_buckets(lengths, cfg.batch_tokens) for k in batch]
        write_hidden_shard(store, run, plan, shard_spec(source, plan, trace_sha), source, traces,
                           assemble_shard(states, order, source.storage))
        say(f"hidden-state shard {plan.index} written: {plan.tokens} tokens, {plan.sequences} sequences "
            f"({time.perf_counter() - t0:.1f} s after its requests were queued)")

    # Submitted shards beyond the one being collected: enough that a full window of requests_in_flight is still
    # queued when a shard completes, so the engine's batch never drains between shards. Each submitted shard's
    # rows wait in the spool until written, which bounds the lookahead.
    per_shard = max(1, min(len(traces) for _, traces in jobs)) if jobs else 1
    lookahead = max(1, -(-cfg.requests_in_flight // per_shard))
    writers = ThreadPoolExecutor(max_workers=cfg.writer_threads, thread_name_prefix="draftline-shard-writer")
    writes: list[Future] = []
    try:
        submitted = deque(submit(i) for i in range(min(len(jobs), 1 + lookahead)))
        for i, (plan, traces) in enumerate(jobs):
            futures, started = submitted.popleft()
            states = [f.result() for f in futures]
            if i + 1 + lookahead < len(jobs):
                submitted.append(submit(i + 1 + lookahead))
            while sum(not w.done() for w in writes) >= cfg.writer_threads:
                wait([w for w in writes if not w.done()], return_when=FIRST_COMPLETED)
            for w in writes:
                if w.done() and w.exception() is not None:
                    raise w.exception()
            writes.append(writers.submit(write, plan, traces, states, started))
        for w in writes:
            w.result()
    finally:
        writers.shutdown(wait=True, cancel_futures=True)
