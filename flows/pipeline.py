"""The whole job as one flow: traces → extraction → training → export → evaluation; `python -m flows.pipeline CONFIG`."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import uuid
from typing import Any, Iterator

from prefect import flow
from prefect.context import FlowRunContext
from prefect.runtime import flow_run

from draftline.config import PipelineConfig
from draftline.config_loading import load_config, merge_overrides, parse_config
from draftline.errors import ConfigError, report_failure
from draftline.overrides import PipelineOverrides, overrides_dict
from draftline.run_lock import RunLease, RunNameTaken
from draftline.run_summary import summary_text
from flows import deployed, stages
from flows.deployed import StageRuns
from flows.evaluate import EngineRuns, evaluate
from tasks.common import final_table_logged, store_at, timed_stage
from tasks.inputs import check_inputs


@flow(name="pipeline", log_prints=True)
def pipeline(config: PipelineConfig | None = None, engine_runs: EngineRuns = "in-process",
             stage_runs: StageRuns = "in-process", config_file: str | None = None,
             overrides: PipelineOverrides | None = None) -> dict:
    """Run every stage; each is resumable, so a rerun after a failure redoes only what is missing.

    Args:
        config: A whole pipeline config; when given, config_file is not read.
        engine_runs: "deployments": each engine's evaluation runs on its engine's pool; "in-process": in this run.
        stage_runs: "deployments": the GPU stages (traces, extraction, training with export, the reference decoder)
            run as flow runs of their own deployments on their pools, each of which needs a live worker first.
        config_file: The YAML config on the worker's checkout, relative to it (the deployment gives
            configs/demo.yaml).
        overrides: Keys laid over config_file section by section, e.g. {"train": {"max_steps": 20}}; an unknown
            key, a wrong type or a malformed store URI is refused when the run is submitted.
    """
    started = time.monotonic()
    config = resolve_config(config, config_file, overrides)
    # Every input in seconds, before any stage; where stages run on other workers, what is missing here is theirs to
    # check when their stage starts.
    check_inputs(config, here=engine_runs == "in-process" and stage_runs == "in-process")
    # Nothing starts on a pool without a live worker: the run fails now, naming the pool and the command to start one.
    deployed.require_live_workers(deployed.deployments_needed(config, engine_runs, stage_runs))
    # The same three stages, as subflows of this run or as flow runs of their deployments: same inputs, same outputs.
    stage_flows = deployed if stage_runs == "deployments" else stages
    times: list[dict] = []
    # One live run per run name: a second run of this name is refused here, before it writes anything.
    with owning_the_run_name(config) as lease:
        with timed_stage("traces", times):
            traces = stage_flows.generate_traces(config)
        lease.check()
        hidden_manifest = ""  # online training (train.source: engine) captures its states while it trains: no shards
        if config.train.source == "shards":
            with timed_stage("extraction", times):
                hidden_manifest = stage_flows.extract_hidden_states(config)
            lease.check()
        with timed_stage("training and export", times):
            drafter = stage_flows.train_drafter(config, hidden_manifest)
        lease.check()
        with timed_stage("evaluation", times), deployed.subflows_tagged_like_this_run():
            report = evaluate(config, drafter["exports"], engine_runs, stage_runs)
    if FlowRunContext.get().flow_run.deployment_id is not None:
        # A deployment's run has no terminal of its own: its log, which `--watch` and `prefect flow-run logs` show,
        # ends with the final table and the stage times, as `draftline run` does.
        print(summary_text(config, report, elapsed_s=time.monotonic() - started, stage_times=times))
        final_table_logged(FlowRunContext.get().flow_run.id)
    return {"traces": traces, "hidden": hidden_manifest, "drafter": drafter, "report": report, "stage_times": times}


@contextlib.contextmanager
def owning_the_run_name(config: PipelineConfig) -> Iterator[RunLease]:
    """Hold the run name's lease (draftline.run_lock) for this flow run while the block runs. A retry of this flow run
    (`prefect flow-run retry`) is the same owner and takes the lease back at once, as a resume should."""
    run_id = str(flow_run.get_id() or uuid.uuid4())
    lease = RunLease(store_at(config.store.root), config.run, owner=run_id, label=f"flow run {run_id}",
                     stop_hint=f"prefect flow-run cancel {run_id}")
    with lease.held():
        if lease.took_over is not None:
            print(f"took over the lease on run {config.run} from {lease.took_over.get('label', 'a run')}, last renewed "
                  f"{lease.took_over.get('renewed_at', 'at an unknown time')}")
        print(f"flow run {run_id} holds the run name {config.run} ({lease.store.uri(lease.key)})")
        yield lease


def resolve_config(config: PipelineConfig | None, config_file: str | None,
                   overrides: PipelineOverrides | dict[str, Any] | None) -> PipelineConfig:
    """The run's config: `config` or the file, with the overrides merged in and validated as a whole."""
    overrides = overrides_dict(overrides)
    if config is None and not config_file:
        raise ConfigError("the pipeline needs a config: pass config_file (e.g. configs/demo.yaml, relative to the "
                          "worker's checkout) or a whole config")
    if config is not None:
        if not overrides:
            return config
        return parse_config(merge_overrides(config.model_dump(mode="json"), overrides), PipelineConfig,
                            "config with overrides")
    print(f"config: {config_file}" + (f" with overrides {json.dumps(overrides)}" if overrides else ""))
    return load_config(config_file, PipelineConfig, overrides)


def main(argv: list[str] | None = None) -> int:
    """Run the pipeline locally (ephemeral Prefect API unless PREFECT_API_URL is set) and print the final table."""
    import argparse

    from draftline.aux_ids import AuxLayerIdsError
    from draftline.cli import load_with_overrides
    from draftline.errors import DraftlineError, EngineError
    from draftline.inputs import check_inputs
    from draftline.run_summary import print_summary, report_location

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("config", nargs="?", help="pipeline config (YAML), e.g. configs/demo.yaml")
    parser.add_argument("--config-json", help="the config as JSON (what `draftline run` passes)")
    parser.add_argument("--store", help="override store.root")
    parser.add_argument("--run", help="override the run name")
    args = parser.parse_args(argv)
    # The temporary Prefect server started here sends no telemetry (it logs a traceback on machines without
    # internet); a user's own setting wins.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        if args.config_json:
            config = parse_config(json.loads(args.config_json), PipelineConfig, "--config-json")
        elif args.config:
            config = load_with_overrides(args.config, args.store, args.run)
        else:
            parser.error("give a config file or --config-json")
    except DraftlineError as exc:
        print(f"draftline: {exc}", file=sys.stderr)
        return 2
    # Every stage runs in this process: what the config names must be here, checked before minutes of work start.
    problems = check_inputs(config).problems
    if problems:
        for line in problems:
            print(f"draftline: {line}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        result = pipeline(config)
    except Exception as exc:  # noqa: BLE001 - every failure becomes its sentence and exit code
        # A run name another live run holds is refused before any stage, like bad input.
        code = report_failure(exc, bad_input=isinstance(exc, RunNameTaken))
        # Only an engine's failure comes after the report is rewritten with its row; other stages leave it as it was.
        report = report_location(config) if isinstance(exc, (EngineError, AuxLayerIdsError)) else None
        if report:
            print(f"draftline: the report, with the failed engine's row, is at {report}", file=sys.stderr)
        return code
    print_summary(config, result["report"], elapsed_s=time.monotonic() - started, stage_times=result["stage_times"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
