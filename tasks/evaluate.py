"""Prefect tasks for evaluation: one engine (supervised loads, retried), the reference decoder, parity, the report."""
from __future__ import annotations

from prefect import task

from draftline import stages
from draftline.config import EngineConfig, PipelineConfig
from tasks.common import CACHED_TASK, publish_link, publish_markdown, publish_table, store_at, transient_retries


@task(name="evaluate-engine", **CACHED_TASK,
      **transient_retries(retries=2, base_delay_s=15.0))
def evaluate_engine(config: PipelineConfig, engine: EngineConfig, exports: dict[str, str]) -> str:
    """Baseline and EAGLE-3 runs of one engine; returns the store key of its EvalResult JSON.

    Cached on its inputs like every stage (a pipeline rerun is served from cache); the nightly run uses a
    new run name each night, so it always measures today's engine. The launcher itself retries flaky loads.
    """
    return stages.evaluate_engine(config, engine, exports, store_at(config.store.root))


@task(name="check-exports")
def misread_exports(config: PipelineConfig, exports: dict[str, str]) -> dict[str, Exception]:
    """{engine: refusal} for the exports an engine would misread, from the files alone (not retried: a file does not
    change by asking again); each refused engine's failed row is in the store."""
    return stages.misread_exports(config, exports, store_at(config.store.root))


def servable_here(engine: EngineConfig) -> bool:
    """Whether this worker's environment can serve the engine (for an evaluation whose engines run in-process)."""
    return stages.servable_here(engine)


def result_key(config: PipelineConfig, engine: EngineConfig) -> str:
    """The store key of an engine's EvalResult, where a failed evaluation also leaves its row."""
    return stages.engine_result_key(config, engine)


def reference_key(config: PipelineConfig) -> str:
    """The store key of the reference decoder's result, where a reference flow run on another worker leaves it."""
    return stages.reference_key(config)


@task(name="reference-acceptance", **CACHED_TASK, **transient_retries(retries=1))
def reference_acceptance(config: PipelineConfig, exports: dict[str, str]) -> str:
    """Engine-independent acceptance of the drafter on the eval prompts; returns the store key of its JSON."""
    return stages.reference(config, exports, store_at(config.store.root))


@task(name="report")
def report(config: PipelineConfig, result_keys: list[str], reference_key: str | None) -> dict:
    """Parity for each engine, then the markdown + PNG report in the store; published as Prefect artifacts."""
    store = store_at(config.store.root)
    rendered = stages.report(config, store, result_keys, reference_key)
    run = config.run
    publish_table(f"{run}-eval-summary", rendered["rows"],
                  f"draftline evaluation of run {run}: acceptance, speedup and parity per engine and concurrency")
    publish_markdown(f"{run}-eval-report", rendered["markdown"], f"draftline evaluation report, run {run}",
                     images_from=(store, rendered["report_key"].rsplit("/", 1)[0]))
    publish_link(f"{run}-eval-report-link", store, rendered["report_key"], "the report in the artifact store")
    return rendered
