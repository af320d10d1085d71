"""The evaluation flows: one engine on its own worker (evaluate-engine), and the fan-out over engines (evaluate)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from prefect import flow
from prefect.deployments import run_deployment

from draftline.config import EngineConfig, PipelineConfig
from draftline.errors import EngineError
from tasks import evaluate as eval_tasks

EngineRuns = Literal["in-process", "deployments"]


@flow(name="evaluate-engine", log_prints=True)
def evaluate_engine(config: PipelineConfig, engine: EngineConfig, exports: dict[str, str]) -> str:
    """One engine's baseline and EAGLE-3 runs; deployed on that engine's work pool (gpu-vllm, gpu-sglang, cpu)."""
    return eval_tasks.evaluate_engine(config, engine, exports)


def _engine_deployment_run(config: PipelineConfig, engine: EngineConfig, exports: dict[str, str]) -> str:
    """Run evaluate-engine as its own flow run on the engine's pool and wait; a failed child fails here."""
    child = run_deployment(name=f"evaluate-engine/evaluate-{engine.engine}",
                           parameters={"config": config.model_dump(mode="json"),
                                       "engine": engine.model_dump(mode="json"), "exports": exports},
                           timeout=None)
    # run_deployment never raises on a failed child: check its final state.
    if not child.state or not child.state.is_completed():
        raise EngineError(f"the {engine.engine} evaluation run {child.name} ended "
                          f"{child.state.name if child.state else 'without a state'}; see it in the Prefect UI",
                          transient=False)
    # The child wrote its EvalResult to the store; the parent reads it there, so no result storage needs to be
    # shared between the engine's worker and this one (Kubernetes pods share none).
    return f"{config.run}/eval/{engine.engine}/result.json"


@flow(name="evaluate", log_prints=True)
def evaluate(config: PipelineConfig, exports: dict[str, str], engine_runs: EngineRuns = "in-process") -> dict:
    """The reference decoder, then every engine in parallel, then parity and the report.

    The reference runs first, not beside the engines: it times plain against speculative decoding, and on a
    machine that also serves an engine both timings would measure the contention.
    """
    reference = eval_tasks.reference_acceptance(config, exports)
    if engine_runs == "deployments":
        with ThreadPoolExecutor(max_workers=len(config.eval.engines) or 1) as pool:
            result_keys = list(pool.map(lambda e: _engine_deployment_run(config, e, exports), config.eval.engines))
    else:
        futures = [eval_tasks.evaluate_engine.submit(config, e, exports) for e in config.eval.engines]
        result_keys = [f.result() for f in futures]
    return eval_tasks.report(config, result_keys, reference)
