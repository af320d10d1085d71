"""The stage flows: generate_traces, extract_hidden_states, train_drafter; each reads like its step of the DAG."""
from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from draftline.config import PipelineConfig
from tasks import drafter as drafter_tasks
from tasks import extract as extract_tasks
from tasks import online as online_tasks
from tasks import traces as trace_tasks
from tasks.common import artifact_key, publish_table
from tasks.inputs import check_inputs


def _shard_by_shard(config: PipelineConfig, stage: str, shard_task, count: int) -> list:
    """Run one task per shard, in order, updating a progress artifact as each finishes.

    In order, not in parallel threads: transformers switches torch's process-wide default dtype while it loads a
    model, which corrupts a forward pass running in another thread. Parallelism across shards comes from
    running the stage on several workers, each a process of its own.
    """
    progress_id = create_progress_artifact(progress=0.0, key=artifact_key(config.run, stage, "progress"),
                                           description=f"{stage}: shards finished")
    results = []
    for i in range(count):
        results.append(shard_task(config, i))
        update_progress_artifact(progress_id, progress=100.0 * (i + 1) / max(1, count))
    return results


@flow(name="generate-traces", log_prints=True)
def generate_traces(config: PipelineConfig) -> dict:
    """The target answers the training prompts; traces land in <store>/<run>/traces/."""
    check_inputs(config, "traces")
    if trace_tasks.uses_offline_engine(config):
        stats = trace_tasks.trace_stage(config)
    else:
        shards = _shard_by_shard(config, "traces", trace_tasks.trace_shard, trace_tasks.shard_count(config))
        stats = trace_tasks.trace_stats(config, shards)
    publish_table(f"{config.run}-traces", [{k: v for k, v in stats.items() if not isinstance(v, (dict, list))}],
                  f"trace generation of run {config.run}")
    return stats


@flow(name="extract-hidden-states", log_prints=True)
def extract_hidden_states(config: PipelineConfig) -> str:
    """The target re-reads every trace; aux and last hidden states land in <store>/<run>/hidden/."""
    check_inputs(config, "extraction")
    if extract_tasks.uses_engine(config):
        stage = extract_tasks.extract_stage(config)
        publish_table(f"{config.run}-extraction",
                      [{k: v for k, v in stage.items() if not isinstance(v, (dict, list))}],
                      f"hidden-state extraction of run {config.run} through vLLM")
        return stage["manifest"]
    shards = _shard_by_shard(config, "extraction", extract_tasks.extract_shard, extract_tasks.shard_count(config))
    publish_table(f"{config.run}-extraction",
                  [{k: v for k, v in s.items() if not isinstance(v, (dict, list))} for s in shards],
                  f"hidden-state shards of run {config.run}")
    return extract_tasks.extract_manifest(config, shards)


@flow(name="train-drafter-online", log_prints=True)
def train_online(config: PipelineConfig) -> dict:
    """Online training: the capturing vLLM server and the trainer at the same time, as two tasks; a failure is the
    failed side's own error."""
    online_tasks.prepare(config)
    engine = online_tasks.feed_engine.submit(config)
    trainer = online_tasks.train_from_engine.submit(config)
    trainer.wait()
    online_tasks.trainer_done(config, trainer.state.is_completed())
    engine.wait()
    online_tasks.clean_up(config)
    if engine.state.is_failed():  # the trainer stopped because of it: the engine side's error names the cause
        engine.result()
    return trainer.result()


@flow(name="train-drafter", log_prints=True)
def train_drafter(config: PipelineConfig, hidden_manifest_uri: str = "") -> dict:
    """Train the EAGLE-3 head (on the extracted shards, or fed by an engine: train.source) and export it for every
    configured engine."""
    check_inputs(config, "training")
    if config.train.source == "engine":
        training = train_online(config)
    else:
        training = drafter_tasks.train_drafter(config, hidden_manifest_uri)
    val = training.get("final_val") or {}
    publish_table(f"{config.run}-training", [{"steps": training.get("steps"), **{k: v for k, v in val.items()
                                                                                   if not isinstance(v, (dict, list))}}],
                  f"drafter training of run {config.run}: final validation")
    exports = drafter_tasks.export_drafter(config, training)
    return {"training": training, "exports": exports}
