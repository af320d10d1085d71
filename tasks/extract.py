"""Prefect tasks for hidden-state extraction: one task per shard (transformers), or one per stage when a vLLM server
reads every shard, then the stage manifest."""
from __future__ import annotations

from prefect import task

from draftline import stages
from draftline.config import PipelineConfig
from tasks.common import CACHED_TASK, store_at, transient_retries


@task(name="extract-shard", **CACHED_TASK, **transient_retries())
def extract_shard(config: PipelineConfig, shard_index: int) -> dict:
    """Hidden states of one shard of traces; a shard already published intact is skipped by the library."""
    return stages.extract_shard(config, store_at(config.store.root), shard_index)


@task(name="extract-stage", **CACHED_TASK, **transient_retries())
def extract_stage(config: PipelineConfig) -> dict:
    """Every pending shard through one supervised vLLM server (a start costs minutes; finished shards are skipped);
    the result names the stage manifest's URI under "manifest"."""
    store = store_at(config.store.root)
    return {**stages.extract(config, store), "manifest": stages.hidden_manifest_uri(config, store)}


@task(name="extract-manifest", **CACHED_TASK, **transient_retries())
def extract_manifest(config: PipelineConfig, shard_results: list[dict]) -> str:
    """Write the stage manifest once every shard exists; returns its store URI."""
    return stages.finish_extraction(config, store_at(config.store.root), len(shard_results))


def stored_manifest(config: PipelineConfig) -> str:
    """The finished stage's manifest URI, where an extraction flow run on another worker left it."""
    return stages.hidden_manifest_uri(config, store_at(config.store.root))


def uses_engine(config: PipelineConfig) -> bool:
    return stages.extraction_in_one_server(config)


def shard_count(config: PipelineConfig) -> int:
    return stages.hidden_shard_count(config, store_at(config.store.root))
