"""Stages as flow runs of their own deployments: each runs on the work pool deployments/prefect.yaml gives it, with the
GPU count its config asks for as the `gpus` job variable, and the parent waits for it and reads what it made from the
store (workers share no result storage: Kubernetes pods share none).

Nothing waits forever: before the pipeline starts a child run it checks that each pool it needs has a live worker,
and a child that no worker takes (child_runs.start_timeout_s) or that runs too long (child_runs.timeout_s) is
cancelled and fails its parent with the cause. Each child is started by a task of the parent ("train-drafter on
gpu-train"), its parent task run, so the parent's page in the UI shows it in place and the task ends as the child did.
A stage run of the same name that has not ended (its parent crashed and was retried) is waited for, not started again.
"""
from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Literal

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.context import TaskRunContext
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
from prefect.states import Cancelled, Cancelling, Scheduled

from draftline import stages
from draftline.config import ChildRunsConfig, PipelineConfig
from draftline.errors import DraftlineError
from tasks import drafter as drafter_tasks
from tasks import evaluate as eval_tasks
from tasks import extract as extract_tasks
from tasks import traces as trace_tasks

# in-process: a stage runs inside the parent flow run, on its worker. deployments: as a flow run of its deployment.
StageRuns = Literal["in-process", "deployments"]

# The deployments (flow/deployment) the pipeline starts with stage_runs "deployments", in the order it needs them.
STAGE_DEPLOYMENTS = ("generate-traces/generate-traces", "extract-hidden-states/extract-hidden-states",
                     "train-drafter/train-drafter", "reference-acceptance/reference-acceptance")
# Seconds between two reads of a waited-for child run.
POLL_S = 3.0
# Scheduled states in which a run waits for something other than a worker: a deployment's concurrency slot (another
# run holds it) or its retry delay.
_WAITING_FOR_OTHER_THAN_A_WORKER = ("AwaitingConcurrencySlot", "AwaitingRetry")


class StageRunFailed(DraftlineError):
    """A stage's own flow run did not complete; its logs are in that run."""


class NoLiveWorker(DraftlineError):
    """A work pool the run needs has no worker that could take its flow runs."""


def engine_deployment(engine: str) -> str:
    """The deployment that evaluates one engine on that engine's pool."""
    return f"evaluate-engine/evaluate-{engine}"


def deployments_needed(config: PipelineConfig, engine_runs: str, stage_runs: str,
                       stage_deployments: tuple[str, ...] = STAGE_DEPLOYMENTS) -> list[str]:
    """Every deployment a run starts flow runs of with these run modes (the pipeline's stages, or only some)."""
    needed = list(stage_deployments) if stage_runs == "deployments" else []
    if config.train.source == "engine":  # online training captures its states itself: no extraction stage
        needed = [d for d in needed if not d.startswith("extract-hidden-states/")]
    if engine_runs == "deployments":
        needed += [engine_deployment(e.engine) for e in config.eval.engines]
    return needed


def _is_live(worker, now: datetime) -> bool:
    """A worker that the server counts online and whose last heartbeat is at most two of its intervals old."""
    if str(getattr(worker.status, "value", worker.status)).upper() != "ONLINE" or worker.last_heartbeat_time is None:
        return False
    beat = worker.last_heartbeat_time
    if beat.tzinfo is None:
        beat = beat.replace(tzinfo=timezone.utc)
    return now - beat <= timedelta(seconds=2 * (worker.heartbeat_interval_seconds or 30) + 10)


def require_live_workers(deployments: Iterable[str]) -> None:
    """Fail, before anything starts, unless every pool these deployments run on has a live worker; one sentence per
    missing deployment, missing or paused pool, or pool without a live worker, naming the command that fixes it."""
    deployments = list(dict.fromkeys(deployments))
    if not deployments:
        return
    pools: dict[str, list[str]] = {}
    problems: list[str] = []
    with get_client(sync_client=True) as client:
        for name in deployments:
            try:
                pools.setdefault(client.read_deployment_by_name(name).work_pool_name, []).append(name)
            except ObjectNotFound:
                problems.append(f"deployment {name} does not exist on the Prefect server at {client.api_url}; "
                                "deploy it with `prefect deploy --all --prefect-file deployments/prefect.yaml`")
        now = datetime.now(timezone.utc)
        for pool, names in pools.items():
            needed_by = ", ".join(names)
            if pool is None:
                problems.append(f"deployment {needed_by} has no work pool; give it one in deployments/prefect.yaml "
                                "and deploy again")
                continue
            try:
                work_pool = client.read_work_pool(pool)
            except ObjectNotFound:
                problems.append(f"work pool {pool} (needed by {needed_by}) does not exist; create it with "
                                f"`prefect work-pool create {pool} --type process` (or infra/k8s/apply-pools.sh) "
                                f"and start a worker with `prefect worker start --pool {pool}`")
                continue
            if work_pool.is_paused:
                problems.append(f"work pool {pool} (needed by {needed_by}) is paused; resume it with "
                                f"`prefect work-pool resume {pool}`")
                continue
            if not any(_is_live(w, now) for w in client.read_workers_for_work_pool(pool)):
                problems.append(f"work pool {pool} has no live worker to run {needed_by}; start one with "
                                f"`prefect worker start --pool {pool}`")
    if problems:
        raise NoLiveWorker("\n".join(problems))


def _end(client, run: FlowRun, message: str) -> None:
    """Cancel a child that will not be waited for: at once if no worker has it, through its worker otherwise."""
    state = run.state
    new = Cancelled(message=message) if state is None or state.is_scheduled() else Cancelling(message=message)
    client.set_flow_run_state(run.id, new, force=True)


def _wait(client, run: FlowRun, deployment: str, pool: str, limits: ChildRunsConfig) -> FlowRun:
    """Poll the child until it ends; cancel it and raise when no worker takes it or it runs past its limit."""
    created = unclaimed_since = time.monotonic()
    while True:
        run = client.read_flow_run(run.id)
        state = run.state
        if state is not None and state.is_final():
            return run
        now = time.monotonic()
        if state is None or (state.is_scheduled() and state.name not in _WAITING_FOR_OTHER_THAN_A_WORKER):
            if now - unclaimed_since > limits.start_timeout_s:
                message = (f"the {deployment} run {run.name} waited {limits.start_timeout_s:.0f} s "
                           f"(child_runs.start_timeout_s) without a worker of work pool {pool} taking it, so it was "
                           f"cancelled; start a worker with `prefect worker start --pool {pool}` and check that the "
                           f"pool and its work queue are not paused (`prefect work-pool inspect {pool}`)")
                _end(client, run, message)
                raise StageRunFailed(message)
        else:
            unclaimed_since = now
        if now - created > limits.timeout_s:
            message = (f"the {deployment} run {run.name} did not finish within {limits.timeout_s:.0f} s "
                       f"(child_runs.timeout_s), so it was cancelled; raise child_runs.timeout_s if this stage needs "
                       "longer")
            _end(client, run, message)
            raise StageRunFailed(message)
        time.sleep(min(POLL_S, limits.start_timeout_s / 4))


@task(name="run-on-pool", cache_policy=NO_CACHE, persist_result=False)
def run_on_pool(deployment: str, parameters: dict[str, Any], gpus: int, limits: ChildRunsConfig,
                run_name: str) -> str:
    """One flow run of a deployment on its pool with this many GPUs (the pools' templates turn `gpus` into the pod's
    GPU limit), this task its parent task run, waited for within the limits; fails unless the run completed
    (run_deployment would return a failed run without a word). Returns the run's id."""
    parent = TaskRunContext.get()
    with get_client(sync_client=True) as client:
        found = client.read_deployment_by_name(deployment)
        pool = found.work_pool_name or "(no pool)"
        run = _unfinished_run(client, found.id, run_name)
        if run is not None and run.parameters != parameters:
            raise StageRunFailed(
                f"the {deployment} run {run.name} ({run.id}) has not ended and runs another config of this run name; "
                f"wait for it, cancel it (`prefect flow-run cancel {run.id}`), or give this run another `run` name")
        if run is not None:  # a retried or restarted parent: that run still owns the stage's store keys
            print(f"{deployment} run {run.name} ({run.id}) has not ended ({run.state.name if run.state else 'no state'});"
                  f" waiting for it instead of starting the stage twice")
        else:
            run = _create_linked(client, found.id, parameters, run_name, parent.task_run.id if parent else None, gpus)
            print(f"started {deployment} run {run.name} ({run.id}) on work pool {pool}")
        run = _wait(client, run, deployment, pool, limits)
    state = run.state
    if not state.is_completed():
        why = f": {state.message}" if state.message else ""
        raise StageRunFailed(f"the {deployment} run {run.name} ended {state.name}{why}; see its logs in the Prefect UI")
    return str(run.id)


def _unfinished_run(client, deployment_id, run_name: str) -> FlowRun | None:
    """The deployment's run of this name that has not ended, if any. A parent whose worker died is retried while its
    child stage goes on on another pool; starting the stage again would put two runs on the same store keys (two
    trainers on one checkpoint folder), so the retry waits for the one still running."""
    from prefect.client.schemas.filters import (
        DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterName, FlowRunFilterState,
        FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=[run_name]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED]))),
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
    return runs[0] if runs else None


def _create_linked(client, deployment_id, parameters: dict[str, Any], run_name: str, parent_task_run_id,
                   gpus: int, link_wait_s: float = 60.0):
    """The child flow run, linked to this task's run. The server records a task run from the events it receives, a
    moment after the task starts; until then linking to it is refused (409 Conflict), so the request is repeated
    for up to link_wait_s, and the child starts unlinked rather than not at all."""
    deadline = time.monotonic() + link_wait_s
    while True:
        try:
            return client.create_flow_run_from_deployment(
                deployment_id, parameters=parameters, state=Scheduled(), name=run_name,
                parent_task_run_id=parent_task_run_id, job_variables={"gpus": gpus})
        except PrefectHTTPStatusError as exc:
            if parent_task_run_id is None or exc.response.status_code != 409:
                raise
            if time.monotonic() > deadline:
                print(f"the server has not recorded task run {parent_task_run_id} after {link_wait_s:.0f} s; "
                      f"starting {run_name} without a link to it")
                parent_task_run_id = None
            else:
                time.sleep(1.0)


def _named(deployment: str, name: str):
    """run_on_pool as the calling flow's task named after what it runs: "train-drafter on gpu-train" in the UI."""
    with get_client(sync_client=True) as client:
        pool = client.read_deployment_by_name(deployment).work_pool_name
    return run_on_pool.with_options(task_run_name=f"{name} on {pool}")


def run_child(deployment: str, parameters: dict[str, Any], gpus: int, config: PipelineConfig, name: str) -> str:
    """A child run of the deployment, named after the pipeline's run and what it does ("demo-train-drafter"),
    waited for; raises StageRunFailed unless it completed."""
    return _named(deployment, name)(deployment, parameters, gpus, config.child_runs, f"{config.run}-{name}")


def submit_child(deployment: str, parameters: dict[str, Any], gpus: int, config: PipelineConfig, name: str):
    """run_child in the background: a future of the task that waits for the child."""
    return _named(deployment, name).submit(deployment, parameters, gpus, config.child_runs, f"{config.run}-{name}")


def _run_stage(flow_name: str, stage: str, config: PipelineConfig, **parameters: Any) -> None:
    run_child(f"{flow_name}/{flow_name}", {"config": config.model_dump(mode="json"), **parameters},
              stages.stage_gpus(config, stage), config, flow_name)


def generate_traces(config: PipelineConfig) -> dict:
    """The generate-traces flow on its pool; returns the stage's stats."""
    _run_stage("generate-traces", "traces", config)
    return trace_tasks.stored_stats(config)


def extract_hidden_states(config: PipelineConfig) -> str:
    """The extract-hidden-states flow on its pool; returns the stage manifest's URI."""
    _run_stage("extract-hidden-states", "extract", config)
    return extract_tasks.stored_manifest(config)


def train_drafter(config: PipelineConfig, hidden_manifest_uri: str) -> dict:
    """The train-drafter flow (training and export) on its pool; returns the training summary and the exports."""
    _run_stage("train-drafter", "train", config, hidden_manifest_uri=hidden_manifest_uri)
    return drafter_tasks.stored_training(config)


def reference_acceptance(config: PipelineConfig, exports: dict[str, str]) -> str:
    """The reference-acceptance flow on its pool; returns the store key of its result."""
    _run_stage("reference-acceptance", "reference", config, exports=exports)
    return eval_tasks.reference_key(config)
