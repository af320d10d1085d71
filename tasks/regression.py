"""Prefect tasks for the nightly regression check: find the production drafter, judge, publish, record, alert."""
from __future__ import annotations

from prefect import task
from prefect.events import emit_event
from prefect.runtime import flow_run

from draftline import regression, stages
from draftline.config import PipelineConfig
from tasks.common import publish_link, publish_markdown, publish_table, store_at, transient_retries


@task(name="production-drafter", **transient_retries(retries=2, base_delay_s=5.0))
def production_drafter(config: PipelineConfig, drafter: str) -> dict:
    """The exports under the drafter URI (copied into tonight's run when they live in another store), their
    fingerprints and lineage; fails early when an engine's export is missing."""
    return stages.production_drafter(config, store_at(config.store.root), drafter).model_dump(mode="json")


@task(name="judge-against-history", **transient_retries(retries=2, base_delay_s=5.0))
def judge(config: PipelineConfig, drafter: dict, history_prefix: str, evaluation_error: str | None = None) -> dict:
    """Tonight's EvalResults against each engine's history series; returns the Verdict as JSON."""
    verdict, results = stages.judge_regression(config, store_at(config.store.root),
                                               regression.ProductionDrafter.model_validate(drafter), history_prefix,
                                               evaluation_error)
    return {"verdict": verdict.model_dump(mode="json"), "results": [r.model_dump(mode="json") for r in results]}


@task(name="publish-comparison", **transient_retries(retries=2, base_delay_s=5.0))
def publish(config: PipelineConfig, judged: dict, history_prefix: str) -> dict[str, str]:
    """comparison.md/.json and history.png in the store, and the same table and page as Prefect artifacts."""
    store = store_at(config.store.root)
    verdict = regression.Verdict.model_validate(judged["verdict"])
    compared = stages.compare_with_history(config, store, verdict, history_prefix)
    keys = compared["keys"]
    state = "REGRESSED" if verdict.regressed else "passed"
    publish_table("nightly-regression-table", compared["rows"],
                  f"nightly regression check ({state}) of drafter {verdict.drafter} on {verdict.target}: tonight "
                  "against the last good run and the rolling median")
    publish_markdown("nightly-regression", compared["markdown"]
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
    keys = stages.record_history(config, store, verdict, results, history_prefix, accept_new_baseline, nightly_run)
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
