"""The nightly regression flow: evaluate the production drafter on every engine, compare with history, alert on a drop.

`python -m flows.nightly CONFIG DRAFTER_URI` runs it once locally; deployments/prefect.yaml schedules it.
"""
from __future__ import annotations

import os
import sys
from datetime import datetime, timezone

from prefect import flow
from prefect.runtime import flow_run

from draftline.config import PipelineConfig
from draftline.errors import report_failure
from draftline.overrides import PipelineOverrides
from draftline.regression import RegressionDetected
from flows import deployed
from flows.deployed import StageRuns
from flows.evaluate import EngineRuns, evaluate
from flows.pipeline import resolve_config
from tasks import regression as regression_tasks


def nightly_run_name(config: PipelineConfig, now: datetime | None = None) -> str:
    """Each night evaluates into its own store run, so no result or cached reference of another night is reused."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    return f"{config.run}-nightly-{stamp}"


@flow(name="regression-check", log_prints=True)
def regression_check(config: PipelineConfig, drafter: dict, history_prefix: str = "history",
                     accept_new_baseline: bool = False, evaluation_error: str | None = None) -> dict:
    """Judge the evaluation of run `config.run` against history, publish the comparison, record it, alert on a drop.

    `drafter` is what the production-drafter task returned; `evaluation_error` explains engines without a result.
    Fails with the verdict's message on a regression.
    """
    judged = regression_tasks.judge(config, drafter, history_prefix, evaluation_error)
    report = regression_tasks.publish(config, judged, history_prefix)
    records = regression_tasks.record(config, judged, history_prefix, accept_new_baseline, _nightly_run_id())
    verdict = judged["verdict"]
    message = _message(judged)
    print(message)
    if any(e["status"] in ("regressed", "failed") for e in verdict["engines"]):
        event_id = regression_tasks.emit_regression_event(judged, report["comparison.md"])
        print(f"emitted draftline.regression.detected ({event_id}); history: {', '.join(records)}")
        raise RegressionDetected(message)
    return {"verdict": verdict, "report": report, "history": records}


@flow(name="nightly-regression", log_prints=True)
def nightly_regression(config: PipelineConfig | None = None, drafter: str = "./runs/demo/export",
                       history_prefix: str = "history", accept_new_baseline: bool = False,
                       engine_runs: EngineRuns = "in-process", stage_runs: StageRuns = "in-process",
                       config_file: str | None = None, overrides: PipelineOverrides | None = None) -> dict:
    """The production drafter on the pinned eval prompts on every configured engine, compared with the last good
    night and the rolling median; fails and emits an event on a regression.

    Args:
        config: A whole pipeline config; when given, config_file is not read.
        drafter: The drafter in production: the exports folder (with vllm/ and sglang/ inside), a local path or a
            store URI such as s3://bucket/runs/my-run/export.
        history_prefix: Where the nightly history lives in the store, relative to its root.
        accept_new_baseline: Record tonight as good whatever the verdict (after an intended change).
        engine_runs: "deployments": each engine's evaluation runs on its engine's pool; "in-process": in this run.
        stage_runs: "deployments": the reference decoder runs on its own (GPU) pool.
        config_file: The YAML config on the worker's checkout, relative to it, read as the pipeline reads it.
        overrides: Keys laid over config_file section by section; an unknown key, a wrong type or a malformed store
            URI is refused when the run is submitted.
    """
    config = resolve_config(config, config_file, overrides)
    needed = deployed.deployments_needed(config, engine_runs, stage_runs,
                                         stage_deployments=("reference-acceptance/reference-acceptance",))
    deployed.require_live_workers(needed)  # nothing waits on a pool without a worker
    tonight = config.model_copy(update={"run": nightly_run_name(config)})
    production = regression_tasks.production_drafter(tonight, drafter)
    with deployed.subflows_tagged_like_this_run():
        evaluation = evaluate(tonight, production["exports"], engine_runs, stage_runs, return_state=True)
        error = None
        if not evaluation.is_completed():
            # An engine that cannot serve is judged too: its result.json (status failed) or its absence is recorded.
            error = evaluation.message or evaluation.name
            print(f"the evaluation ended {evaluation.name} ({error}); judging what it left in the store")
        return regression_check(tonight, production, history_prefix, accept_new_baseline, error)


def _nightly_run_id() -> str | None:
    """The nightly-regression flow run this check belongs to (itself when run on its own), for the history."""
    run_id = flow_run.get_parent_flow_run_id() or flow_run.get_id()
    return str(run_id) if run_id else None


def _message(judged: dict) -> str:
    from draftline.regression import Verdict

    return Verdict.model_validate(judged["verdict"]).message()


def main(argv: list[str] | None = None) -> int:
    """Run the nightly check once (ephemeral Prefect API unless PREFECT_API_URL is set); exit 1 on a regression."""
    import argparse

    from draftline.cli import load_with_overrides
    from draftline.errors import ConfigError, DraftlineError, StoreError
    from draftline.inputs import STAGE_INPUTS, check_inputs
    from draftline.regression.inputs import engine_exports

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("config", help="pipeline config (YAML), e.g. configs/demo.yaml")
    parser.add_argument("drafter", help="store URI of the production drafter's exports, e.g. ./runs/demo/export")
    parser.add_argument("--history-prefix", default="history", help="store prefix of the history (default: history)")
    parser.add_argument("--accept-new-baseline", action="store_true", help="record tonight as good whatever it shows")
    parser.add_argument("--store", help="override store.root")
    args = parser.parse_args(argv)
    # The temporary Prefect server started here sends no telemetry (it logs a traceback on machines without
    # internet); a user's own setting wins.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        config = load_with_overrides(args.config, args.store, None)
    except DraftlineError as exc:
        print(f"draftline: {exc}", file=sys.stderr)
        return 2
    # Every engine runs from this process: what the evaluations read, and the drafter, checked before any starts.
    needs = STAGE_INPUTS["reference"] + STAGE_INPUTS["evaluation"] + ("eval.engines",)
    problems = check_inputs(config, needs=needs).problems
    try:
        engine_exports(args.drafter, [e.engine for e in config.eval.engines])
    except ConfigError as exc:
        problems.append(str(exc))
    except StoreError as exc:
        if not exc.transient:  # refused credentials; a network blip is left to the flow's task, which retries
            problems.append(str(exc))
    if problems:
        for line in problems:
            print(f"draftline: {line}", file=sys.stderr)
        return 2
    try:
        result = nightly_regression(config, args.drafter, args.history_prefix, args.accept_new_baseline)
    except RegressionDetected as exc:
        print(f"draftline: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - every failure becomes its sentence and exit code
        return report_failure(exc)
    print(_message({"verdict": result["verdict"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
