"""The stage flows: generate_traces, extract_hidden_states, train_drafter; each reads like its step of the DAG."""
from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.futures import wait

from draftline.config import PipelineConfig
from tasks import drafter as drafter_tasks
from tasks import extract as extract_tasks
from tasks import traces as trace_tasks
from tasks.common import artifact_key, publish_table


def _with_progress(config: PipelineConfig, stage: str, futures: list) -> list:
    """Wait for shard futures, updating a progress artifact as they finish; returns their results in order."""
    progress_id = create_progress_artifact(progress=0.0, key=artifact_key(config.run, stage, "progress"),
                                           description=f"{stage}: shards finished")
    done = 0
    pending = list(futures)
    while pending:
        finished, still = wait(pending, timeout=5)
        if len(finished) != done or not still:
            done = len(futures) - len(still)
            update_progress_artifact(progress_id, progress=100.0 * done / max(1, len(futures)))
        pending = list(still)
    return [f.result() for f in futures]


@flow(name="generate-traces", log_prints=True)
def generate_traces(config: PipelineConfig) -> dict:
    """The target answers the training prompts; traces land in <store>/<run>/traces/."""
    if trace_tasks.uses_offline_engine(config):
        stats = trace_tasks.trace_stage(config)
    else:
        futures = [trace_tasks.trace_shard.submit(config, i) for i in range(trace_tasks.shard_count(config))]
        stats = trace_tasks.trace_stats(config, _with_progress(config, "traces", futures))
    publish_table(f"{config.run}-traces", [{k: v for k, v in stats.items() if not isinstance(v, (dict, list))}],
                  f"trace generation of run {config.run}")
    return stats


@flow(name="extract-hidden-states", log_prints=True)
def extract_hidden_states(config: PipelineConfig) -> str:
    """The target re-reads every trace; aux and last hidden states land in <store>/<run>/hidden/."""
    futures = [extract_tasks.extract_shard.submit(config, i) for i in range(extract_tasks.shard_count(config))]
    shards = _with_progress(config, "extraction", futures)
    publish_table(f"{config.run}-extraction",
                  [{k: v for k, v in s.items() if not isinstance(v, (dict, list))} for s in shards],
                  f"hidden-state shards of run {config.run}")
    return extract_tasks.extract_manifest(config, shards)


@flow(name="train-drafter", log_prints=True)
def train_drafter(config: PipelineConfig, hidden_manifest_uri: str = "") -> dict:
    """Train the EAGLE-3 head and export it for every configured engine."""
    training = drafter_tasks.train_drafter(config, hidden_manifest_uri)
    val = training.get("final_val") or {}
    publish_table(f"{config.run}-training", [{"steps": training.get("steps"), **{k: v for k, v in val.items()
                                                                                   if not isinstance(v, (dict, list))}}],
                  f"drafter training of run {config.run}: final validation")
    exports = drafter_tasks.export_drafter(config, training)
    return {"training": training, "exports": exports}
