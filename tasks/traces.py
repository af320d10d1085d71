"""Prefect tasks for trace generation: one task per shard, or one per stage when a vLLM engine serves all shards."""
from __future__ import annotations

from prefect import task

from draftline import stages
from draftline.config import PipelineConfig
from tasks.common import CACHED_TASK, store_at, transient_retries


@task(name="trace-shard", **CACHED_TASK, **transient_retries())
def trace_shard(config: PipelineConfig, shard_index: int) -> dict:
    """Answer one shard of prompts (transformers backend or a served vLLM endpoint); skips a shard already published."""
    return stages.trace_shard(config, store_at(config.store.root), shard_index)


@task(name="trace-stage", **CACHED_TASK, **transient_retries())
def trace_stage(config: PipelineConfig) -> dict:
    """All pending shards through one offline vLLM engine (a start costs minutes; finished shards are skipped)."""
    return stages.traces(config, store_at(config.store.root))


@task(name="trace-stats", **CACHED_TASK, **transient_retries())
def trace_stats(config: PipelineConfig, shard_results: list[dict]) -> dict:
    """Stats and stage manifest once every shard is published (shard_results only orders this after them)."""
    return stages.finish_traces(config, store_at(config.store.root))


def stored_stats(config: PipelineConfig) -> dict:
    """The finished stage's stats from the store, where a trace flow run on another worker left them."""
    return stages.stored_trace_stats(config, store_at(config.store.root))


def shard_count(config: PipelineConfig) -> int:
    return stages.trace_shard_count(config)


def uses_offline_engine(config: PipelineConfig) -> bool:
    return stages.traces_in_one_server(config)
