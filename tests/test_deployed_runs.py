"""The deployed pipeline on a real Prefect server with real process workers, as a user starts it: it reads
configs/demo.yaml with a partial `--param overrides=...` merged in, refuses a bad override at submission, refuses to
start on pools without a live worker, checks its inputs where they are read (the pipeline's worker, then each stage's), and never
waits forever for a child run that no worker takes. No stage does any work here:
each test ends before the first stage would run, so the module takes a couple of minutes."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from tests.fixtures.prefect_server import ROOT, kill_group

pytestmark = [pytest.mark.prefect]

# Pools of this module's own (deployments/prefect.yaml's names with a prefix), so that no worker another module of
# the same server started, nor its last heartbeat, counts here.
PREFIX = "t32-"
DEPLOYMENTS = ("pipeline", "generate-traces", "extract-hidden-states", "train-drafter", "reference-acceptance",
               "evaluate-vllm", "evaluate-sglang")


def _prefect_file(tmp: Path) -> Path:
    spec = yaml.safe_load((ROOT / "deployments/prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        deployment["work_pool"]["name"] = PREFIX + deployment["work_pool"]["name"]
    path = tmp / "prefect.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def server(prefect_server, tmp_path_factory):
    """The deployments created as docs/prefect.md says (on this module's pools), and a worker on the pipeline's
    pool."""
    tmp = tmp_path_factory.mktemp("deployed-runs")
    for pool in ("cpu", "gpu-vllm", "gpu-sglang", "gpu-train"):
        prefect_server.cli("work-pool", "create", PREFIX + pool, "--type", "process", "--overwrite")
    names = [arg for name in DEPLOYMENTS for arg in ("--name", name)]
    prefect_server.cli("--no-prompt", "deploy", "--prefect-file", str(_prefect_file(tmp)), *names, timeout=600)
    workers = {"cpu": prefect_server.start_worker(PREFIX + "cpu", tmp / "worker-cpu.log")}
    prefect_server.tmp, prefect_server.workers = tmp, workers
    try:
        yield prefect_server
    finally:
        for worker in workers.values():
            kill_group(worker)


def _client(server):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    return temporary_settings({PREFECT_API_URL: server.api_url})


def _run(server, *params: str, timeout: float = 300) -> tuple[object, float]:
    """`prefect deployment run pipeline/pipeline --watch` with these --param arguments; the ended flow run."""
    started = time.monotonic()
    args = [a for p in params for a in ("--param", p)]
    res = server.cli("deployment", "run", "pipeline/pipeline", *args, "--watch", "--watch-interval", "2",
                     timeout=timeout, check=False)
    elapsed = time.monotonic() - started
    out = res.stdout + res.stderr
    run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1)
    run = server.read(lambda c: c.read_flow_run(run_id))
    assert res.returncode != 0 and run.state.is_failed(), f"the pipeline run should have failed:\n{out[-3000:]}"
    return run, elapsed


def test_bad_overrides_are_refused_at_submission_naming_the_field(server):
    """The deployment's parameter schema is strict: `prefect deployment run` itself refuses, no flow run is made."""
    before = len(server.read(lambda c: c.read_flow_runs()))
    for override, named in (('{"train": {"max_stepz": 20}}', "'max_stepz' was unexpected"),
                            ('{"train": {"learning_rate": "fast"}}', "overrides.train.learning_rate"),
                            ('{"store": {"root": "s3:/typo"}}', "overrides.store.root"),
                            ('{"train": {"max_steps": 0}}', "overrides.train.max_steps")):
        res = server.cli("deployment", "run", "pipeline/pipeline", "--param", f"overrides={override}", check=False)
        out = res.stdout + res.stderr
        assert res.returncode != 0 and "Validation failed" in out and named in out, out[-2000:]
    assert len(server.read(lambda c: c.read_flow_runs())) == before, "a refused submission created a flow run"


def test_pools_without_a_live_worker_fail_the_run_before_anything_starts_naming_the_command(server):
    server.wait_for_worker(PREFIX + "cpu")
    run, elapsed = _run(server, 'overrides={"run": "t32-no-workers"}')
    message = run.state.message
    # One sentence per pool, each with the command that fixes it; the pipeline's own pool has its worker.
    for pool in ("gpu-vllm", "gpu-train", "gpu-sglang"):
        assert (f"work pool {PREFIX}{pool} has no live worker" in message
                and f"`prefect worker start --pool {PREFIX}{pool}`" in message), message
    assert f"{PREFIX}cpu " not in message
    children = server.read(lambda c: c.read_flow_runs())
    assert not [r for r in children if r.name.startswith("t32-no-workers-")], "a child run was started"
    print(f"failed after {elapsed:.0f} s")


def test_wrong_inputs_fail_an_in_process_run_before_any_stage_naming_each_field(server):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    server.wait_for_worker(PREFIX + "cpu")
    overrides = {"run": "t32-inputs-here", "target": {"path": "/nonexistent/target"},
                 "eval": {"prompts": "assets/prompts/none.jsonl"}}
    run, _ = _run(server, f"overrides={json.dumps(overrides)}", 'engine_runs="in-process"', 'stage_runs="in-process"')
    message = run.state.message
    for named in ("run t32-inputs-here cannot start", "point target.path at a transformers checkpoint directory",
                  "set eval.prompts to a .jsonl, .json or .parquet file"):
        assert named in message, message
    # Its only task is the check: no stage's subflow (each has a task run in its parent) began.
    tasks = server.read(lambda c: c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))))
    assert [t.name.rsplit("-", 1)[0] for t in tasks] == ["check-inputs"], [t.name for t in tasks]


def _start_workers(server, pools) -> None:
    for pool in pools:
        if pool not in server.workers:
            server.workers[pool] = server.start_worker(PREFIX + pool, server.tmp / f"worker-{pool}.log")
    for pool in pools:
        server.wait_for_worker(PREFIX + pool)


def test_an_input_missing_on_a_stage_worker_fails_that_stage_naming_the_field(server):
    """The pipeline's worker lets a path it lacks pass (its stages run on other workers, which may have it); the
    traces stage checks it on its own worker before loading anything, and the run fails with that stage's sentence."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    _start_workers(server, ("gpu-vllm", "gpu-train"))
    overrides = {"run": "t32-inputs-there", "target": {"path": "/nonexistent/target"}}
    run, _ = _run(server, f"overrides={json.dumps(overrides)}", 'engine_runs="in-process"')
    message = run.state.message
    assert ("the generate-traces/generate-traces run t32-inputs-there-generate-traces ended Failed" in message
            and "the traces stage cannot start" in message
            and "point target.path at a transformers checkpoint directory" in message), message
    later = server.read(lambda c: c.read_flow_runs(flow_run_filter=FlowRunFilter(
        name=FlowRunFilterName(any_=["t32-inputs-there-extract-hidden-states"]))))
    assert not later, "extraction started after the traces stage refused its inputs"


def test_a_child_run_no_worker_takes_is_cancelled_after_the_configured_time(server):
    """Live workers on every pool, but the traces pool's queue paused: the child waits, the pipeline gives up after
    child_runs.start_timeout_s with the pool named, the child is cancelled, and it hangs off the pipeline's task."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    _start_workers(server, ("gpu-vllm", "gpu-train"))
    server.cli("work-queue", "pause", "default", "--pool", PREFIX + "gpu-vllm")
    overrides = {"run": "t32-timeout", "train": {"max_steps": 7}, "child_runs": {"start_timeout_s": 15}}
    run, _ = _run(server, f"overrides={json.dumps(overrides)}", 'engine_runs="in-process"')
    message = run.state.message
    assert ("waited 15 s (child_runs.start_timeout_s) without a worker of work pool t32-gpu-vllm taking it"
            in message and "`prefect worker start --pool t32-gpu-vllm`" in message), message

    child = server.read(lambda c: c.read_flow_runs(
        flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["t32-timeout-generate-traces"]))))
    assert len(child) == 1 and child[0].state.is_cancelled(), child
    # The child got the whole config: configs/demo.yaml with the override merged in, not the override alone.
    config = child[0].parameters["config"]
    demo = yaml.safe_load((ROOT / "configs/demo.yaml").read_text())
    assert config["train"]["max_steps"] == 7 and config["train"]["learning_rate"] == demo["train"]["learning_rate"]
    assert [e["engine"] for e in config["eval"]["engines"]] == [e["engine"] for e in demo["eval"]["engines"]]
    # Linked to the pipeline run through a task of it named after what it ran.
    parent_task = server.read(lambda c: c.read_task_run(child[0].parent_task_run_id))
    assert parent_task.flow_run_id == run.id and parent_task.name == "generate-traces on t32-gpu-vllm"
    assert parent_task.state.is_failed()


def test_a_stage_run_that_has_not_ended_is_waited_for_not_started_twice(server):
    """A pipeline whose worker died is retried while its child stage still runs on another pool: the retry must not
    start that stage a second time (two trainers on one checkpoint folder). Here the unfinished child is a run of the
    same name and parameters left Running (no worker has it); the parent's task takes it as its child and waits."""
    from prefect import flow
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.states import Running

    from draftline.config import ChildRunsConfig
    from flows.deployed import StageRunFailed, run_on_pool

    name = "t32-twice-generate-traces"
    params = {"config": yaml.safe_load((ROOT / "configs/demo.yaml").read_text())}

    async def leave_a_child(client):
        deployment = await client.read_deployment_by_name("generate-traces/generate-traces")
        return await client.create_flow_run_from_deployment(deployment.id, parameters=params, name=name,
                                                            state=Running())

    @flow
    def parent(parameters: dict):
        return run_on_pool("generate-traces/generate-traces", parameters, 1, ChildRunsConfig(timeout_s=5), name)

    left = server.read(leave_a_child)
    other = {"config": {**params["config"], "train": {**params["config"]["train"], "max_steps": 3}}}
    with _client(server):
        with pytest.raises(StageRunFailed, match=r"has not ended and runs another config of this run name; .*"
                                                 rf"`prefect flow-run cancel {left.id}`"):
            parent(other)
        with pytest.raises(StageRunFailed, match=r"did not finish within 5 s \(child_runs.timeout_s\)"):
            parent(params)
    children = server.read(lambda c: c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name]))))
    assert [c.id for c in children] == [left.id], children  # no second traces run was started
    assert children[0].state.name in ("Cancelling", "Cancelled"), children[0].state


def test_a_run_name_another_live_run_holds_is_refused_before_any_stage_naming_that_run(server):
    """Two pipeline runs given one run name: the second is refused at once, with the holder's flow run id, and
    nothing of the holder's is touched. The holder here is a lease as a live run keeps it (renewed just now)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from draftline.layout import run_lease_key, training_record_key
    from draftline.run_lock import RunLease
    from draftline.store import open_store

    server.wait_for_worker(PREFIX + "cpu")
    root = server.tmp / "taken-store"
    store = open_store(str(root))
    holder = "0b5c1d2e-0000-4000-8000-00000000abcd"
    RunLease(store, "t32-taken", holder, label=f"flow run {holder}",
             stop_hint=f"prefect flow-run cancel {holder}").acquire()
    store.put_bytes(training_record_key("t32-taken"), b'{"steps": 7}')
    lease = store.get_bytes(run_lease_key("t32-taken"))

    overrides = {"run": "t32-taken", "store": {"root": str(root)}}
    run, _ = _run(server, f"overrides={json.dumps(overrides)}", 'engine_runs="in-process"', 'stage_runs="in-process"')
    message = run.state.message
    assert (f"the run name 't32-taken' is taken: flow run {holder}" in message
            and f"`prefect flow-run cancel {holder}`" in message), message
    tasks = server.read(lambda c: c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))))
    assert [t.name.rsplit("-", 1)[0] for t in tasks] == ["check-inputs"], [t.name for t in tasks]
    assert store.get_bytes(run_lease_key("t32-taken")) == lease
    assert store.list("t32-taken") == sorted([run_lease_key("t32-taken"), training_record_key("t32-taken")])


def test_a_retried_parent_takes_its_child_back_and_tags_one_of_another_config_superseded(server):
    """In one parent flow run, as in a retried pipeline run, a child of the same name and config is the same run,
    retried in place when it did not complete, not a second one; one of another config is a new run, and the old one
    is tagged superseded. No worker serves the SGLang pool here, so each child is cancelled after its start timeout."""
    from prefect import flow
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from draftline.config import ChildRunsConfig
    from flows.deployed import SUPERSEDED_TAG, StageRunFailed, run_on_pool

    name = "t32-retried-evaluate-sglang"
    demo = yaml.safe_load((ROOT / "configs/demo.yaml").read_text())
    other = {**demo, "train": {**demo["train"], "max_steps": 3}}
    sglang = next(e for e in demo["eval"]["engines"] if e["engine"] == "sglang")

    @flow
    def parent() -> list[str]:
        failures = []
        for config in (demo, demo, other):
            try:
                run_on_pool("evaluate-engine/evaluate-sglang", {"config": config, "engine": sglang, "exports": {}}, 1,
                            ChildRunsConfig(start_timeout_s=3), name)
            except StageRunFailed as exc:
                failures.append(str(exc))
        return failures

    with _client(server):
        failures = parent()
    assert len(failures) == 3 and all("(child_runs.start_timeout_s)" in f for f in failures), failures
    children = sorted(server.read(lambda c: c.read_flow_runs(
        flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))), key=lambda r: r.created)
    assert [c.parameters["config"]["train"]["max_steps"] for c in children] == [demo["train"]["max_steps"], 3]
    first, replacement = children
    scheduled = [s for s in server.read(lambda c: c.read_flow_run_states(first.id)) if s.is_scheduled()]
    assert len(scheduled) == 2, "the second call did not retry the first child in place"
    assert SUPERSEDED_TAG in first.tags and SUPERSEDED_TAG not in replacement.tags, (first.tags, replacement.tags)
