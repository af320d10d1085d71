"""Prefect tasks for the drafter: training (resumes from its own checkpoints) and per-engine export."""
from __future__ import annotations

from prefect import get_run_logger, task

from draftline.config import PipelineConfig
from draftline import stages
from tasks.common import CACHED_TASK, store_at, transient_retries


@task(name="train-drafter", **CACHED_TASK, **transient_retries(retries=1))
def train_drafter(config: PipelineConfig, hidden_manifest_uri: str) -> dict:
    """Train on the run's hidden-state shards; a retry or rerun resumes from the last checkpoint in the store.

    With train.processes > 1 the ranks run under torchrun on this worker, and their output is this task's log.
    """
    return stages.train(config, store_at(config.store.root), on_line=get_run_logger().info)


@task(name="export-drafter", **CACHED_TASK, **transient_retries())
def export_drafter(config: PipelineConfig, training: dict) -> dict[str, str]:
    """One directory per engine format; returns {format: store URI of the export}."""
    return stages.export(config, store_at(config.store.root))


def stored_training(config: PipelineConfig) -> dict:
    """The training summary and exports from the store, where a train-drafter flow run on another worker left them."""
    return stages.stored_training(config, store_at(config.store.root))
