"""Prefect tasks for the nightly regression check: find the production drafter, judge, publish, record, alert."""
from __future__ import annotations

from prefect import task
from prefect.events import emit_event
from prefect.runtime import flow_run

from draftline import regression, stages
from draftline.config import PipelineConfig
from draftline.layout import regression_prefix
from tasks.common import publish_link, publish_markdown, publish_table, store_at, transient_retries


@task(name="production-drafter", **transient_retries(retries=2, base_delay_s=5.0))
def production_drafter(config: PipelineConfig, drafter: str) -> dict:
    """The exports under the drafter URI (copied into tonight's run when they live in another store), their
    fingerprints and lineage; fails early when an engine's export is missing."""
    formats = [e.engine for e in config.eval.engines]
    store = store_at(config.store.root)
    return regression.production_drafter(drafter, formats, store, config.run).model_dump(mode="json")


@task(name="judge-against-history", **transient_retries(retries=2, base_delay_s=5.0))
def judge(config: PipelineConfig, drafter: dict, history_prefix: str, evaluation_error: str | None = None) -> dict:
    """Tonight's EvalResults against each engine's history series; returns the Verdict as JSON."""
    store = store_at(config.store.root)
    production = regression.ProductionDrafter.model_validate(drafter)
    lineage = regression.lineage_name(production.lineage, production.uri.rstrip("/").rsplit("/", 1)[-1])
    results = regression.load_results(
        store, config.run, [e.engine for e in config.eval.engines], config.target.display_name,
        config.eval.prompts.rsplit("/", 1)[-1], config.eval.reference_k,
        drafter=production.uri, drafter_lineage=production.lineage, missing_reason=evaluation_error)
    # The production drafter's own training record (through its lineage), not this run's: it holds the offline
    # estimate the measured acceptance is compared with.
    verdict = regression.judge_all(results, regression.History(store, history_prefix), config.regression,
                                   fingerprints=production.fingerprints, lineage=lineage, drafter=production.uri,
                                   target=config.target.display_name, target_fingerprint=_target_fingerprint(config),
                                   training_record=stages.lineage_training_record(store, production.exports))
    return {"verdict": verdict.model_dump(mode="json"), "results": [r.model_dump(mode="json") for r in results]}


def _target_fingerprint(config: PipelineConfig) -> str | None:
    """Tells a changed target from a changed drafter; only for a target in a local folder."""
    from pathlib import Path

    from draftline.target import target_fingerprint

    return target_fingerprint(config.target.path) if Path(config.target.path, "config.json").is_file() else None


@task(name="publish-comparison", **transient_retries(retries=2, base_delay_s=5.0))
def publish(config: PipelineConfig, judged: dict, history_prefix: str) -> dict[str, str]:
    """comparison.md/.json and history.png in the store, and the same table and page as Prefect artifacts."""
    store = store_at(config.store.root)
    verdict = regression.Verdict.model_validate(judged["verdict"])
    history = regression.History(store, history_prefix)
    keys = regression.write_comparison(verdict, history, config.regression, store, regression_prefix(config.run))
    state = "REGRESSED" if verdict.regressed else "passed"
    publish_table("nightly-regression-table", regression.comparison_rows(verdict, config.regression),
                  f"nightly regression check ({state}) of drafter {verdict.drafter} on {verdict.target}: tonight "
                  "against the last good run and the rolling median")
    publish_markdown("nightly-regression", regression.comparison_markdown(verdict, config.regression, plot_name=None)
                     + f"\nPlot and raw figures: {store.uri(keys['history.png'])}, "
                       f"{store.uri(keys['comparison.json'])}\n",
                     f"nightly regression check: {state}")
    publish_link("nightly-regression-plot", store, keys["history.png"], "history plot of the nightly check")
    return {name: store.uri(key) for name, key in keys.items()}


@task(name="record-history", **transient_retries(retries=2, base_delay_s=5.0))
def record(config: PipelineConfig, judged: dict, history_prefix: str, accept_new_baseline: bool,
           nightly_run: str | None) -> list[str]:
    """Append tonight's records to the history, whatever the verdict."""
    store = store_at(config.store.root)
    verdict = regression.Verdict.model_validate(judged["verdict"])
    results = [regression.EvalResult.model_validate(r) for r in judged["results"]]
    keys = regression.record(verdict, results, regression.History(store, history_prefix),
                             accept=accept_new_baseline, nightly_run=nightly_run, drafter_uri=verdict.drafter)
    return [store.uri(k) for k in keys]


@task(name="emit-regression-event")
def emit_regression_event(judged: dict, report_uri: str | None) -> str | None:
    """`draftline.regression.detected` with the figures in the payload; deployments/automations.yaml notifies on it."""
    verdict = regression.Verdict.model_validate(judged["verdict"])
    payload = verdict.event_payload(report_uri)
    # Prefect relates the event to this task's own flow run (regression-check); the nightly run that started it is
    # what a user opens from an alert, so it is related too.
    parent = flow_run.get_parent_flow_run_id()
    related = [{"prefect.resource.id": f"prefect.flow-run.{parent}", "prefect.resource.role": "nightly-run"}] if parent else []
    event = emit_event(
        event=regression.EVENT_NAME,
        resource={
            "prefect.resource.id": f"draftline.drafter.{verdict.target}.{verdict.lineage}",
            "prefect.resource.name": f"drafter {verdict.lineage} for {verdict.target}",
            "draftline.target": verdict.target,
            "draftline.lineage": verdict.lineage,
            "draftline.causes": ",".join(payload["causes"]),
        },
        payload=payload,
        related=related,
    )
    return str(event.id) if event else None
