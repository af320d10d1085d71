"""The evaluation flows: one engine on its own worker (evaluate-engine), the reference decoder (reference-acceptance),
and the fan-out over engines (evaluate)."""
from __future__ import annotations

from typing import Literal

from prefect import flow

from draftline import stages
from draftline.config import EngineConfig, PipelineConfig
from draftline.errors import EngineError
from flows import deployed
from flows.deployed import StageRuns
from tasks import evaluate as eval_tasks
from tasks.common import store_at, store_run_id
from tasks.inputs import check_inputs

EngineRuns = Literal["in-process", "deployments"]


@flow(name="evaluate-engine", log_prints=True)
def evaluate_engine(config: PipelineConfig, engine: EngineConfig, exports: dict[str, str]) -> str:
    """One engine's baseline and EAGLE-3 runs; deployed on that engine's work pool (gpu-vllm, gpu-sglang, cpu)."""
    check_inputs(config, "evaluation")
    return eval_tasks.evaluate_engine(config, engine, exports)


@flow(name="reference-acceptance", log_prints=True)
def reference_acceptance(config: PipelineConfig, exports: dict[str, str]) -> str:
    """The reference decoder on its own worker (deployed on the gpu-train pool); returns the store key of its result."""
    check_inputs(config, "reference")
    return eval_tasks.reference_acceptance(config, exports)


def _engine_deployment_run(config: PipelineConfig, engine: EngineConfig, exports: dict[str, str]):
    """Start evaluate-engine as its own flow run on the engine's pool, with the GPUs its servers take, as a task of this
    flow ("evaluate-vllm on gpu-vllm"); returns the task's future. The child writes its EvalResult to the store and
    the parent reads it there, so no result storage is shared between the engine's worker and this one (Kubernetes
    pods share none)."""
    return deployed.submit_child(deployed.engine_deployment(engine.engine),
                                 {"config": config.model_dump(mode="json"), "engine": engine.model_dump(mode="json"),
                                  "exports": exports},
                                 stages.engine_gpus(engine), config, f"evaluate-{engine.engine}")


@flow(name="evaluate", log_prints=True)
def evaluate(config: PipelineConfig, exports: dict[str, str], engine_runs: EngineRuns = "in-process",
             stage_runs: StageRuns = "in-process") -> dict:
    """Each engine's export checked against the training record, the reference decoder, then every engine in
    parallel (or one after the other, eval.engines_in_parallel: false), then parity and the report.

    The reference runs first, not beside the engines: it times plain against speculative decoding, and on a
    machine that also serves an engine both timings would measure the contention. With stage_runs "deployments"
    it runs as a reference-acceptance flow run on that deployment's (GPU) pool.
    """
    # Every pool this evaluation starts runs on must have a live worker, or nothing starts.
    deployed.require_live_workers(deployed.deployments_needed(config, engine_runs, stage_runs,
                                                              deployed.STAGE_DEPLOYMENTS[-1:]))
    # The run's identity, part of every cached task's key, is made here if it is not yet: the evaluation workers'
    # credentials write only evaluations (infra/s3_policy.py), and a nightly's run is new.
    store_run_id(store_at(config.store.root), config.run)
    # An export an engine would misread fails that engine before anything is spent; when no engine is left to
    # serve, the reference decoder (minutes to hours on a real target) does not run either.
    refused = eval_tasks.misread_exports(config, exports)
    engines = [e for e in config.eval.engines if e.engine not in refused]
    served = [e for e in engines if engine_runs == "deployments" or eval_tasks.servable_here(e)]
    reference = None
    if served:
        if stage_runs == "deployments":
            reference = deployed.reference_acceptance(config, exports)
        else:
            reference = eval_tasks.reference_acceptance(config, exports)
    def start(engine: EngineConfig):
        if engine_runs == "deployments":
            return _engine_deployment_run(config, engine, exports)
        return eval_tasks.evaluate_engine.submit(config, engine, exports)

    if config.eval.engines_in_parallel:
        futures = [start(e) for e in engines]
        outcomes = [f.result(raise_on_failure=False) for f in futures]
    else:
        outcomes = [start(e).result(raise_on_failure=False) for e in engines]
    if engine_runs == "deployments":
        # A child that did not complete fails its task; the engine's row and the run's failure name it.
        failures = [EngineError(str(x), transient=False) if isinstance(x, BaseException) else None for x in outcomes]
    else:
        failures = [x if isinstance(x, BaseException) else None for x in outcomes]
    failures = list(refused.values()) + failures
    # The report carries every engine, a failed one with its root cause; then the run fails with that cause.
    failure = next((f for f in failures if f is not None), None)
    try:
        rendered = eval_tasks.report(config, [eval_tasks.result_key(config, e) for e in config.eval.engines],
                                     reference)
    except Exception:
        if failure is not None:
            raise failure  # no report (no engine left a row): the engine's own error is the news
        raise
    if failure is not None:
        raise failure
    return rendered
