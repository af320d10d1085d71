"""A worker killed mid-training under a deployed pipeline, through a real Prefect server with the shipped heartbeat
(deployments/prefect.yaml) and crash automation (deployments/crashed-runs.yaml): the training run is Crashed within
the documented two minutes, the pipeline fails naming one command, and that one retry of the pipeline on a new worker
reuses the stages that completed, retries the training run in place (no second run of its name), trains on from the
last checkpoint in the store, not from step 0, and ends its log with the final table.

Traces and extraction are stand-ins (tests/finished_stages.py) over a store that has their outputs, and the only
engine is SGLang, which reports itself skipped on a machine without a GPU: the time goes to the crash and the retry."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from draftline.layout import trace_stats_key
from draftline.store import copy_tree, open_store
from tests.fixtures.prefect_server import ROOT, kill_group
from tests.fixtures.tiny_targets import build_tokenizer

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

# Pools of this module's own, so that no other module's worker counts here.
PREFIX = "t32c-"
DEPLOYMENTS = ("pipeline", "generate-traces", "extract-hidden-states", "train-drafter", "reference-acceptance")
STAND_INS = {"generate-traces": "tests/finished_stages.py:generate_traces",
             "extract-hidden-states": "tests/finished_stages.py:extract_hidden_states"}
MAX_STEPS = 100
CHECKPOINT_EVERY = 5
# What docs/prefect.md and deployments/crashed-runs.yaml promise: Crashed within two minutes of the process's death.
CRASHED_WITHIN_S = 120


def _config(store_root: Path, target_dir: Path) -> dict:
    return {
        "run": "tiny", "store": {"root": str(store_root)}, "target": {"path": str(target_dir)},
        "traces": {"prompts": "assets/prompts/train_prompts.jsonl"},
        "eval": {"prompts": "assets/prompts/eval_prompts.jsonl",
                 "engines": [{"engine": "sglang", "num_speculative_tokens": 3, "concurrency": [1],
                              "require_gpu": True, "max_model_len": 256}]},
        "drafter": {"draft_vocab_size": 128},
        "train": {"ttt_steps": 3, "tokens_per_batch": 512, "max_seq_len": 256, "warmup_steps": 2,
                  "learning_rate": 3e-3, "val_fraction": 0.25, "num_threads": 1, "device": "cpu",
                  "max_steps": MAX_STEPS, "val_every": MAX_STEPS, "checkpoint_every": CHECKPOINT_EVERY},
        "export": {"formats": ["vllm"]},
    }


@pytest.fixture
def deployed(prefect_server, tmp_path):
    """The shipped crash automation, as it is, and the pipeline with its stage deployments on this module's pools
    (the stand-ins on the pipeline's pool, so that two workers do)."""
    spec = yaml.safe_load((ROOT / "deployments/crashed-runs.yaml").read_text())
    prefect_server.cli("automation", "create", "--from-file", str(ROOT / "deployments/crashed-runs.yaml"))
    deployments = yaml.safe_load((ROOT / "deployments/prefect.yaml").read_text())
    deployments["deployments"] = [d for d in deployments["deployments"] if d["name"] in DEPLOYMENTS]
    for deployment in deployments["deployments"]:
        if deployment["name"] in STAND_INS:
            deployment["entrypoint"] = STAND_INS[deployment["name"]]
            deployment["work_pool"]["name"] = "cpu"
        deployment["work_pool"]["name"] = PREFIX + deployment["work_pool"]["name"]
    (tmp_path / "prefect.yaml").write_text(yaml.safe_dump(deployments, sort_keys=False))
    for pool in ("cpu", "gpu-train"):
        prefect_server.cli("work-pool", "create", PREFIX + pool, "--type", "process", "--overwrite")
    names = [arg for name in DEPLOYMENTS for arg in ("--name", name)]
    prefect_server.cli("--no-prompt", "deploy", "--prefect-file", str(tmp_path / "prefect.yaml"), *names, timeout=600)
    try:
        yield prefect_server
    finally:
        # The automation watches every draftline run of the server: no other module's runs should meet it.
        async def delete(client):
            for automation in await client.read_automations_by_name(spec["automations"][0]["name"]):
                await client.delete_automation(automation.id)

        prefect_server.read(delete)


def _processes_of(run_id: str) -> list[int]:
    """The processes running this flow run (the worker starts it in a process of its own)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"PREFECT__FLOW_RUN_ID={run_id}".encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _until(server, run_id, done, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        run = server.read(lambda c: c.read_flow_run(run_id))
        if done(run.state) or time.monotonic() > deadline:
            return run
        time.sleep(2)


def _runs_named(server, prefix: str) -> list:
    return [r for r in server.read(lambda c: c.read_flow_runs()) if r.name.startswith(prefix)]


def _log_lines(server, run_id, min_level: int = 0, last: bool = False) -> list[str]:
    """The run's log lines at min_level or above, the first ones (or with last, the last ones first)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel
    from prefect.client.schemas.sorting import LogSort

    logs = server.read(lambda c: c.read_logs(
        log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]), level=LogFilterLevel(ge_=min_level)),
        sort=LogSort.TIMESTAMP_DESC if last else LogSort.TIMESTAMP_ASC))
    return [log.message for log in logs]


def test_a_killed_training_worker_crashes_its_run_and_one_pipeline_retry_finishes_the_pipeline(
        deployed, tiny_hidden_run, tmp_path):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from flows.deployed import STAGE_DEPLOYMENTS

    root = tmp_path / "store"
    copy_tree(open_store(str(tiny_hidden_run.store_root)), "tiny/hidden", open_store(str(root)), "tiny/hidden")
    store = open_store(str(root))
    store.put_bytes(trace_stats_key("tiny"), json.dumps({"traces": tiny_hidden_run.sequences}).encode())
    # The pipeline checks the target where it runs: it needs a tokenizer, which the tiny target lacks.
    target = shutil.copytree(tiny_hidden_run.target_dir, tmp_path / "target")
    build_tokenizer(target, vocab_size=256)
    params = {"config": _config(root, target), "engine_runs": "in-process",
              "stage_runs": "deployments"}
    cpu = deployed.start_worker(PREFIX + "cpu", tmp_path / "worker-cpu.log")
    train = deployed.start_worker(PREFIX + "gpu-train", tmp_path / "worker-train1.log")
    second = None
    try:
        deployed.wait_for_worker(PREFIX + "cpu")
        deployed.wait_for_worker(PREFIX + "gpu-train")
        out = deployed.cli("deployment", "run", "pipeline/pipeline", "--params", json.dumps(params))
        pipeline_id = re.search(r"UUID:\s*([0-9a-f-]{36})", out.stdout + out.stderr).group(1)
        latest = "tiny/train/checkpoints/latest.json"
        deadline = time.monotonic() + 300
        while not store.exists(latest):
            assert time.monotonic() < deadline, "training wrote no checkpoint"
            assert not deployed.read(lambda c: c.read_flow_run(pipeline_id)).state.is_final(), "the pipeline ended"
            time.sleep(0.05)
        # A machine or pod that dies takes the worker and the flow run's processes at once: none of them can report.
        training = next(r for r in _runs_named(deployed, "tiny-train-drafter"))
        processes = _processes_of(str(training.id))
        os.killpg(train.pid, signal.SIGKILL)
        for pid in processes:
            os.kill(pid, signal.SIGKILL)
        killed_at = datetime.now(timezone.utc)
        kill_group(train)
        assert processes, "the training run's process was not found"
        checkpoint_step = json.loads(store.get_bytes(latest))["step"]
        assert checkpoint_step < MAX_STEPS
        # A new worker may come up at once: it does not take the orphaned run, which still counts as Running.
        second = deployed.start_worker(PREFIX + "gpu-train", tmp_path / "worker-train2.log")

        # Nothing reports the death: the automation sees the heartbeats stop.
        _until(deployed, training.id, lambda s: s.is_final(), CRASHED_WITHIN_S + 60)
        states = deployed.read(lambda c: c.read_flow_run_states(training.id))
        crashed = next((s for s in states if s.is_crashed()), None)
        assert crashed is not None, [f"{s.name}: {s.message}" for s in states]
        crashed_after = (crashed.timestamp - killed_at).total_seconds()
        assert "No heartbeat for 90 s" in crashed.message, crashed.message
        assert crashed_after <= CRASHED_WITHIN_S, f"Crashed {crashed_after:.0f} s after the kill"

        # The pipeline fails, and it and the training run's message name the one command: retry the pipeline.
        run = _until(deployed, pipeline_id, lambda s: s.is_final(), 120)
        retry = f"prefect flow-run retry {pipeline_id}"
        assert run.state.is_failed() and f"`{retry}`" in run.state.message, run.state.message
        training = deployed.read(lambda c: c.read_flow_run(training.id))
        assert training.state.is_crashed() and f"`{retry}`" in training.state.message, training.state.message
        # --watch shows the run's log: the failure's first line is the cause, in one sentence.
        first_error = _log_lines(deployed, pipeline_id, min_level=40)[0]
        assert first_error.startswith("the train-drafter/train-drafter run tiny-train-drafter crashed: No heartbeat"
                                      ) and "\n" not in first_error and retry in first_error, first_error

        deployed.wait_for_worker(PREFIX + "gpu-train")
        deployed.cli(*retry.split()[1:])
        run = _until(deployed, pipeline_id, lambda s: s.is_final(), 600)
        assert run.state.is_completed(), f"{run.state.name}: {run.state.message}"
    finally:
        for worker in (cpu, train, second):
            if worker is not None:
                kill_group(worker, signal.SIGTERM)
                kill_group(worker)

    metrics = json.loads(store.get_bytes("tiny/train/metrics.json"))
    print(f"killed after the checkpoint at step {checkpoint_step}, Crashed {crashed_after:.0f} s later; the retried "
          f"pipeline trained on from step {metrics.get('resumed_from')}")
    assert metrics["steps"] == MAX_STEPS
    assert checkpoint_step <= metrics["resumed_from"] < MAX_STEPS
    # One run per stage: the finished ones reused, the crashed one retried in place.
    # Stage runs by their exact names: a run Prefect names at random may also begin with "tiny-".
    stage_names = {f"tiny-{deployment.split('/')[0]}" for deployment in STAGE_DEPLOYMENTS}
    children = [r for r in _runs_named(deployed, "tiny-") if r.name in stage_names]
    names = sorted(r.name for r in children if "superseded" not in r.tags)
    assert names == ["tiny-extract-hidden-states", "tiny-generate-traces", "tiny-train-drafter"], names
    assert next(r for r in children if r.name == "tiny-train-drafter").id == training.id
    assert all(r.state.is_completed() for r in children), [(r.name, r.state.name) for r in children]
    # Every run under the pipeline, its evaluate subflow too, is one the crash automation watches.
    below = deployed.read(lambda c: c.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[pipeline_id]))))
    assert len(below) >= 4 and all("draftline" in r.tags for r in below), [(r.name, r.tags) for r in below]
    # The log ends with the final table, as `draftline run` does (the API handler ships the last lines in batches).
    deadline = time.monotonic() + 30
    while not (last := _log_lines(deployed, pipeline_id, last=True)[0]).lstrip().startswith("draftline run 'tiny'"):
        assert time.monotonic() < deadline, f"the pipeline's log ends with:\n{last}"
        time.sleep(1)
    for part in ("sglang", "skipped", "report:", "stages: traces", "training and export", "pipeline finished in"):
        assert part in last, last
