"""A vLLM KV connector (loaded by module path, no patching) that spools each finished request's captured hidden states to a file.

vLLM's `extract_hidden_states` speculative method writes the states of the layers named in
`eagle_aux_hidden_state_layer_ids` into a cache-only KV layer ([blocks, states, block_size, hidden]). When a
request finishes, this connector gathers its rows by block id and, still on the device, turns them into a shard's
rows: the aux states side by side, the last layer's output through the target's final norm (its weight and eps come
from `kv_connector_extra_config.final_norm_file`), both quantized when the request asks for fp8-e4m3 storage. It
copies those to host memory and writes `<spool_dir>/<draftline_key>.safetensors` (the shard's tensor names,
`token_ids`, and the storage in the metadata), renamed into place only when complete. The request names its key and
storage in `kv_transfer_params`; requests without a key are ignored. Only tensor-parallel rank 0 writes: every rank
holds the same full hidden states. With the norm and the quantization done here, the host's work per token is one
copy into the spool and one read by the shard writer.

This module runs inside vLLM's processes and is imported only there (it needs vllm).
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load_file
from vllm.config import get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.logger import init_logger

from draftline.engines.capture_keys import KEY_PARAM, PATH_PARAM, STORAGE_PARAM, error_path, spool_path
from draftline.safetensors_io import write_safetensors
from draftline.state_storage import BF16, FP8_E4M3, SCALE_SUFFIX, STORAGES, quantize_slots
from draftline.target import rms_norm

try:  # SupportsHMA lets vLLM keep the hidden-state cache in its own KV group next to the target's attention
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # older vLLM: no hybrid allocator interface
    class SupportsHMA:  # type: ignore[no-redef]
        pass

logger = init_logger(__name__)


@dataclass
class _Save:
    req_id: str
    path: str
    token_ids: list[int]
    block_ids: list[int]
    storage: str = BF16


@dataclass
class _Meta(KVConnectorMetadata):
    saves: list[_Save] = field(default_factory=list)


class DraftlineHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector: nothing is ever loaded; finished requests' hidden states go to the spool folder."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.spool_dir = str(extra.get("spool_dir") or "")
        if not self.spool_dir:
            raise ValueError("DraftlineHiddenStatesConnector needs kv_connector_extra_config.spool_dir")
        self.final_norm_file = str(extra.get("final_norm_file") or "")
        if not self.final_norm_file:
            raise ValueError("DraftlineHiddenStatesConnector needs kv_connector_extra_config.final_norm_file")
        self._norm: tuple[torch.Tensor, float] | None = None
        self._group = self._hidden_state_group(kv_cache_config)
        # scheduler side
        self._pending: dict[str, _Save] = {}
        # worker side
        self._cache: torch.Tensor | None = None
        self._token_axis = 2
        self._rank0 = True
        self._writers = ThreadPoolExecutor(max_workers=int(extra.get("writer_threads", 4)),
                                           thread_name_prefix="draftline-spool")
        self._copies: dict[str, Any] = {}  # req_id -> CUDA event of its device-to-host copy, or None when done
        self._writes: list[Future] = []
        self._finished: set[str] = set()

    @staticmethod
    def _hidden_state_group(kv_cache_config) -> int:
        """The KV cache group that holds the captured states (the only group when there is one)."""
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) <= 1:
            return 0
        hits = [i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ == "HiddenStateCacheSpec"]
        if len(hits) != 1:
            raise ValueError(f"cannot tell which of {len(groups)} KV cache groups holds the captured hidden states")
        return hits[0]

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = _Meta(saves=list(self._pending.values()))
        self._pending.clear()
        return meta

    def request_finished(self, request, block_ids: list[int]):
        params = getattr(request, "kv_transfer_params", None) or {}
        key = params.get(KEY_PARAM)
        if key is None or request.prompt_token_ids is None:
            return False, None
        storage = str(params.get(STORAGE_PARAM) or BF16)
        try:
            path = spool_path(self.spool_dir, str(key))
            if storage not in STORAGES:
                raise ValueError(f"{STORAGE_PARAM}={storage!r} is none of {', '.join(STORAGES)}")
        except ValueError as exc:  # never let a client's bad request stop the engine: the client times out instead
            logger.warning("draftline capture: %s; request %s not captured", exc, request.request_id)
            return False, None
        self._pending[request.request_id] = _Save(request.request_id, path, list(request.prompt_token_ids),
                                                  list(block_ids), storage)
        return True, {PATH_PARAM: path}

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group])

    def get_finished_count(self) -> int:
        return 1  # rank 0 alone reports a request as sent

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._rank0 = get_tensor_model_parallel_rank() == 0
        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise ValueError(f"expected one cache-only hidden-state layer, found {len(layers)}; start vLLM with "
                             "speculative method extract_hidden_states")
        self._cache = kv_caches[layers[0]]
        # [blocks, states, block_size, hidden] in vLLM 0.32's layout, [blocks, block_size, states, hidden] in 0.25's.
        states = len(getattr(self._vllm_config.speculative_config.draft_model_config.hf_config,
                             "eagle_aux_hidden_state_layer_ids", []) or [])
        shape = tuple(self._cache.shape)
        if len(shape) != 4 or states not in (shape[1], shape[2]) or shape[1] == shape[2]:
            raise ValueError(f"cannot read {states} captured states from a cache of shape {shape}")
        self._token_axis = 2 if shape[1] == states else 1
        if states != 4:
            raise ValueError(f"draftline captures three aux layers and the last one; vLLM was asked for {states}")
        if self._rank0:
            norm = load_file(self.final_norm_file)
            self._norm = (norm["weight"].to(self._cache.device), float(norm["eps"]))

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None  # the states are already in the cache-only layer; they are read when the request finishes

    def wait_for_save(self) -> None:
        return None

    def _rows(self, save: _Save) -> torch.Tensor:
        """The request's rows of the cache-only layer, [tokens, states, hidden], still on the device."""
        block_size = self._cache.shape[self._token_axis]
        blocks = torch.tensor(save.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[: len(save.token_ids)]
        slots = slots.to(self._cache.device)
        if self._token_axis == 2:
            return self._cache[slots // block_size, :, slots % block_size]
        return self._cache[slots // block_size, slots % block_size]

    def _shard_rows(self, save: _Save) -> dict[str, torch.Tensor]:
        """The request's rows as a shard holds them, on the device: aux [n, 3h], the normed last state [n, h],
        and with fp8-e4m3 their scales ([n, 3], [n, 1])."""
        rows = self._rows(save)
        n = rows.shape[0]
        weight, eps = self._norm
        aux = rows[:, :3, :].reshape(n, -1)
        last = rms_norm(rows[:, 3, :], weight, eps)
        if save.storage != FP8_E4M3:
            return {"aux_hidden_states": aux.contiguous(), "last_hidden_states": last.contiguous()}
        (aux, aux_scale), (last, last_scale) = quantize_slots(aux, 3), quantize_slots(last, 1)
        return {"aux_hidden_states": aux, "last_hidden_states": last,
                "aux_hidden_states" + SCALE_SUFFIX: aux_scale.contiguous(),
                "last_hidden_states" + SCALE_SUFFIX: last_scale.contiguous()}

    def _start_save(self, save: _Save) -> None:
        rows = self._shard_rows(save)
        first = next(iter(rows.values()))
        if first.is_cuda:
            stream = torch.cuda.Stream(first.device)
            stream.wait_stream(torch.cuda.current_stream(first.device))
            host = {}
            with torch.cuda.stream(stream):
                for name, t in rows.items():
                    t.record_stream(stream)  # keep the device rows alive until the side stream has read them
                    host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    host[name].copy_(t, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
        else:
            host, copied = dict(rows), None  # gathered by index: new tensors, never views of vLLM's cache
        self._copies[save.req_id] = copied
        host["token_ids"] = torch.tensor(save.token_ids, dtype=torch.int64)
        self._writes.append(self._writers.submit(_write, save.path, host, save.storage, copied))

    def get_finished(self, finished_req_ids: set[str]):
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if self._rank0 and isinstance(meta, _Meta):
            for save in meta.saves:
                self._start_save(save)
        self._writes = [f for f in self._writes if not f.done()]
        self._finished |= set(finished_req_ids)
        sent = set()
        for req_id in list(self._finished):
            if req_id not in self._copies:
                # Not captured (untagged, or another rank): its save, if any, arrived with this very step's metadata.
                self._finished.discard(req_id)
                continue
            event = self._copies[req_id]
            if event is not None and not event.query():
                continue  # the device-to-host copy is still running: the blocks must stay allocated
            del self._copies[req_id]
            self._finished.discard(req_id)
            sent.add(req_id)
        return (sent or None), None

    def shutdown(self):
        self._writers.shutdown(wait=True)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """Each token's states together; the name of that layout changed between vLLM versions ("NHD" in 0.25,
        "LBNHC" in 0.32), so ask the installed vLLM's own hidden-states connector for it."""
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
                ExampleHiddenStatesConnector,
            )
        except ImportError:
            return None
        return ExampleHiddenStatesConnector.get_required_kvcache_layout(vllm_config)


def _write(path: str, tensors: dict[str, torch.Tensor], storage: str, copied) -> None:
    """Write one request's file atomically: a reader that sees the final name sees every byte."""
    if copied is not None:
        copied.synchronize()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write_safetensors(tmp, tensors, {"storage": storage})
        os.replace(tmp, path)
    except BaseException as exc:  # the client waits for the file: tell it why none will come
        with open(error_path(path), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        raise

