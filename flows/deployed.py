"""Stages as flow runs of their own deployments: each runs on the work pool deployments/prefect.yaml gives it, with the
GPU count its config asks for as the `gpus` job variable, and the parent waits for it and reads what it made from the
store (workers share no result storage: Kubernetes pods share none)."""
from __future__ import annotations

from typing import Any, Literal

from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment

from draftline import stages
from draftline.config import PipelineConfig
from draftline.errors import DraftlineError
from tasks import drafter as drafter_tasks
from tasks import evaluate as eval_tasks
from tasks import extract as extract_tasks
from tasks import traces as trace_tasks

# in-process: a stage runs inside the parent flow run, on its worker. deployments: as a flow run of its deployment.
StageRuns = Literal["in-process", "deployments"]


class StageRunFailed(DraftlineError):
    """A stage's own flow run did not complete; its logs are in that run."""


def run_and_wait(deployment: str, parameters: dict[str, Any], gpus: int) -> FlowRun:
    """One flow run of a deployment with this many GPUs (the pools' templates turn `gpus` into the pod's GPU limit),
    waited for; the caller judges its final state, which run_deployment never raises on."""
    return run_deployment(name=deployment, parameters=parameters, job_variables={"gpus": gpus}, timeout=None)


def _run_stage(flow_name: str, stage: str, config: PipelineConfig, **parameters: Any) -> None:
    child = run_and_wait(f"{flow_name}/{flow_name}", {"config": config.model_dump(mode="json"), **parameters},
                         stages.stage_gpus(config, stage))
    if not child.state or not child.state.is_completed():
        ended = child.state.name if child.state else "without a state"
        raise StageRunFailed(f"the {flow_name} run {child.name} ended {ended}; see its logs in the Prefect UI")


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
