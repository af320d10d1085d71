"""Stages as flow runs of their own deployments: each runs on the work pool deployments/prefect.yaml gives it, with the
GPU count its config asks for as the `gpus` job variable, and the parent waits for it and reads what it made from the
store (workers share no result storage: Kubernetes pods share none).

Nothing waits forever: before the pipeline starts a child run it checks that each pool it needs has a live worker,
and a child that no worker takes (child_runs.start_timeout_s) or that runs too long (child_runs.timeout_s) is
cancelled and fails its parent with the cause. Each child is started by a task of the parent ("train-drafter on
gpu-train"), its parent task run, so the parent's page in the UI shows it in place and the task ends as the child did.
A stage run of the same name that has not ended (its parent crashed and was retried) is waited for, not started again.

One retry of the pipeline run resumes everything: each child is created under a key made of the pipeline run's id,
its name and its parameters, so a retried pipeline gets back the child its earlier attempt made. A completed one is
reused, a crashed, failed or cancelled one is retried in place (same run, same name; it resumes from what it stored),
and one left behind by a changed config is tagged `superseded`. A crashed child's message names that retry.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Literal

from prefect import tags, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext, TaskRunContext
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
from prefect.states import Cancelled, Cancelling, Crashed, Scheduled

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
# The tag on a child run that a later attempt of its pipeline run replaced with a run of another config.
SUPERSEDED_TAG = "superseded"


class StageRunFailed(DraftlineError):
    """A stage's own flow run did not complete; its logs are in that run."""


class NoLiveWorker(DraftlineError):
    """A work pool the run needs has no worker that could take its flow runs."""


def subflows_tagged_like_this_run():
    """A block whose subflows carry this flow run's tags (`draftline`, from its deployment): the crash automation
    watches runs by that tag, and Prefect gives a subflow none of its parent's. They beat as often as their parent,
    in its process."""
    context = FlowRunContext.get()
    return tags(*(context.flow_run.tags if context is not None else []))


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
        retried = _outermost_run(client)
        run = _unfinished_run(client, found.id, run_name)
        if run is not None and run.parameters != parameters:
            raise StageRunFailed(
                f"the {deployment} run {run.name} ({run.id}) has not ended and runs another config of this run name; "
                f"wait for it, cancel it (`prefect flow-run cancel {run.id}`), or give this run another `run` name")
        if run is not None:  # a retried or restarted parent: that run still owns the stage's store keys
            print(f"{deployment} run {run.name} ({run.id}) has not ended ({run.state.name if run.state else 'no state'});"
                  f" waiting for it instead of starting the stage twice")
        else:
            run = _create_linked(client, found.id, parameters, run_name, parent.task_run.id if parent else None, gpus,
                                 idempotency_key=_child_key(retried, run_name, parameters))
            run = _start_or_take_back(client, run, deployment, pool)
        _mark_superseded(client, found.id, run, retried)
        run = _wait(client, run, deployment, pool, limits)
        state = run.state
        if state.is_crashed() and retried is not None:
            raise StageRunFailed(_crashed(client, run, deployment, pool, retried))
    if not state.is_completed():
        why = f": {state.message}" if state.message else ""
        raise StageRunFailed(f"the {deployment} run {run.name} ended {state.name}{why}; see its logs in the Prefect UI")
    return str(run.id)


def _outermost_run(client) -> FlowRun | None:
    """The flow run a user retries: the one this code runs in, or, from a subflow (the pipeline's evaluate), the
    run above it that no task of another run started."""
    context = FlowRunContext.get()
    run = context.flow_run if context else None
    while run is not None and run.parent_task_run_id is not None:
        parent_flow_run_id = client.read_task_run(run.parent_task_run_id).flow_run_id
        if parent_flow_run_id is None:
            break
        run = client.read_flow_run(parent_flow_run_id)
    return run


def _child_key(retried: FlowRun | None, run_name: str, parameters: dict[str, Any]) -> str | None:
    """The idempotency key of a child run: the same in every attempt of the outermost run, for the same parameters,
    so the server hands a retried pipeline the child its earlier attempt made."""
    if retried is None:
        return None
    digest = hashlib.sha256(json.dumps(parameters, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{retried.id}/{run_name}/{digest}"


def _start_or_take_back(client, run: FlowRun, deployment: str, pool: str) -> FlowRun:
    """A new child is left to start; one an earlier attempt made is reused when it completed and retried in place
    otherwise, as `prefect flow-run retry` does (it resumes from what it stored)."""
    state = run.state
    if state is None or not state.is_final():
        print(f"started {deployment} run {run.name} ({run.id}) on work pool {pool}")
    elif state.is_completed():
        print(f"{deployment} run {run.name} ({run.id}) completed in an earlier attempt of this run; reusing it")
    else:
        client.set_flow_run_state(run.id, Scheduled(message=f"retried by a retry of the run that started it, after "
                                                            f"it ended {state.name}"), force=True)
        print(f"{deployment} run {run.name} ({run.id}) ended {state.name} in an earlier attempt of this run; "
              f"retrying it on work pool {pool}, where it resumes from what it stored")
        run = client.read_flow_run(run.id)
    return run


def _mark_superseded(client, deployment_id, run: FlowRun, retried: FlowRun | None) -> None:
    """Tag the other runs of this name that earlier attempts of the same outermost run made (with another config),
    so that the UI tells the one in use from the ones it replaced."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterName

    if retried is None:
        return
    same_name = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run.name])),
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
    for other in same_name:
        if (other.id != run.id and SUPERSEDED_TAG not in other.tags
                and (other.idempotency_key or "").startswith(f"{retried.id}/")):
            client.update_flow_run(other.id, tags=[*other.tags, SUPERSEDED_TAG])
            print(f"{other.name} ({other.id}) is superseded by {run.id}: tagged {SUPERSEDED_TAG}")


def _crashed(client, run: FlowRun, deployment: str, pool: str, retried: FlowRun) -> str:
    """The sentence for a child that crashed (its process died: no heartbeat, or its infrastructure exited), also
    written into the child's own state message: the run to retry is the outermost one, whose retry reuses the stages
    that completed and retries this one."""
    cause = re.split(r"(?<=[.;])\s", (run.state.message or "its process stopped").strip(), maxsplit=1)[0].rstrip(".;")
    flow_name = client.read_flow(retried.flow_id).name
    advice = (f"retry {flow_name} run {retried.name} with `prefect flow-run retry {retried.id}` once work pool {pool} "
              f"has a worker: it reuses the stages that completed and retries this one, which resumes from what it "
              f"stored (finished shards, the last training checkpoint)")
    client.set_flow_run_state(run.id, Crashed(message=f"{cause}; this run is a stage of {flow_name} run "
                                                      f"{retried.name} ({retried.id}): {advice}."), force=True)
    return f"the {deployment} run {run.name} crashed: {cause}; {advice}"


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
                   gpus: int, idempotency_key: str | None = None, link_wait_s: float = 60.0):
    """The child flow run, linked to this task's run (or the run an earlier attempt made under the same
    idempotency_key, as it is). The server records a task run from the events it receives, a moment after the task
    starts; until then linking to it is refused (409 Conflict), so the request is repeated for up to link_wait_s, and
    the child starts unlinked rather than not at all."""
    deadline = time.monotonic() + link_wait_s
    while True:
        try:
            return client.create_flow_run_from_deployment(
                deployment_id, parameters=parameters, state=Scheduled(), name=run_name,
                parent_task_run_id=parent_task_run_id, job_variables={"gpus": gpus},
                idempotency_key=idempotency_key)
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
