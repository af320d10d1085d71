"""Prefect tasks for hidden-state extraction: one task per shard (transformers), or one per stage when a vLLM server
reads every shard, then the stage manifest."""
from __future__ import annotations

from prefect import task

from draftline import extract, stages
from draftline.config import PipelineConfig
from draftline.layout import hidden_manifest_key
from tasks.common import CACHED_TASK, store_at, transient_retries


@task(name="extract-shard", **CACHED_TASK, **transient_retries())
def extract_shard(config: PipelineConfig, shard_index: int) -> dict:
    """Hidden states of one shard of traces; a shard already published intact is skipped by the library."""
    return extract.extract_shard(config.extract, config.target.path, store_at(config.store.root), config.run,
                                 shard_index, dtype=config.target.dtype)


@task(name="extract-stage", **CACHED_TASK, **transient_retries())
def extract_stage(config: PipelineConfig) -> dict:
    """Every pending shard through one supervised vLLM server (a start costs minutes; finished shards are skipped);
    the result names the stage manifest's URI under "manifest"."""
    store = store_at(config.store.root)
    result = extract.extract_hidden_states(config.extract, config.target.path, store, config.run,
                                           dtype=config.target.dtype)
    return {**result, "manifest": store.uri(hidden_manifest_key(config.run))}


@task(name="extract-manifest", **CACHED_TASK, **transient_retries())
def extract_manifest(config: PipelineConfig, shard_results: list[dict]) -> str:
    """Write the stage manifest once every shard exists; returns its store URI."""
    store = store_at(config.store.root)
    extract.finalize_hidden_states(store, config.run, len(shard_results))
    return store.uri(hidden_manifest_key(config.run))


def stored_manifest(config: PipelineConfig) -> str:
    """The finished stage's manifest URI, where an extraction flow run on another worker left it."""
    return stages.hidden_manifest_uri(config, store_at(config.store.root))


def uses_engine(config: PipelineConfig) -> bool:
    return config.extract.backend == "vllm"


def shard_count(config: PipelineConfig) -> int:
    return extract.num_hidden_shards(config.extract, store_at(config.store.root), config.run)
