"""A worker killed mid-training, through a real Prefect server: the crash automation of deployments/crashed-runs.yaml
marks the orphaned flow run Crashed once its heartbeats stop, and `prefect flow-run retry` on a new worker trains on
from the last checkpoint in the store, not from step 0."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from draftline.store import copy_tree, open_store
from tests.fixtures.prefect_server import PREFECT, ROOT, kill_group

pytestmark = [pytest.mark.prefect]

POOL = "t32c-gpu-train"
MAX_STEPS = 300
CHECKPOINT_EVERY = 5
# The shortest heartbeat Prefect allows, and the automation's window shrunk to match (the shipped 600 s fits the
# default 180 s heartbeat); everything else is the shipped automation.
HEARTBEAT_S = 30
WITHIN_S = 45


def _config(store_root: Path, target_dir: Path) -> dict:
    return {
        "run": "tiny", "store": {"root": str(store_root)}, "target": {"path": str(target_dir)},
        "traces": {"prompts": "assets/prompts/train_prompts.jsonl"},
        "eval": {"prompts": "assets/prompts/eval_prompts.jsonl"},
        "drafter": {"draft_vocab_size": 128},
        "train": {"ttt_steps": 3, "tokens_per_batch": 512, "max_seq_len": 256, "warmup_steps": 2,
                  "learning_rate": 3e-3, "val_fraction": 0.25, "num_threads": 1, "device": "cpu",
                  "max_steps": MAX_STEPS, "val_every": MAX_STEPS, "checkpoint_every": CHECKPOINT_EVERY},
        "export": {"formats": ["vllm"]},
    }


def _read(server, fn):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def go():
        async with get_client() as client:
            return await fn(client)

    with temporary_settings({PREFECT_API_URL: server.api_url}):
        return asyncio.run(go())


@pytest.fixture
def deployed(prefect_server, tmp_path):
    """The shipped crash automation (window shrunk) and the train-drafter deployment on a pool of this module's."""
    spec = yaml.safe_load((ROOT / "deployments/crashed-runs.yaml").read_text())
    for automation in spec["automations"]:
        automation["trigger"]["within"] = WITHIN_S
    (tmp_path / "crashed-runs.yaml").write_text(yaml.safe_dump(spec))
    prefect_server.cli("automation", "create", "--from-file", str(tmp_path / "crashed-runs.yaml"))
    deployments = yaml.safe_load((ROOT / "deployments/prefect.yaml").read_text())
    deployments["deployments"] = [d for d in deployments["deployments"] if d["name"] == "train-drafter"]
    deployments["deployments"][0]["work_pool"]["name"] = POOL
    (tmp_path / "prefect.yaml").write_text(yaml.safe_dump(deployments, sort_keys=False))
    prefect_server.cli("work-pool", "create", POOL, "--type", "process", "--overwrite")
    prefect_server.cli("--no-prompt", "deploy", "--prefect-file", str(tmp_path / "prefect.yaml"), "--name",
                       "train-drafter", timeout=600)
    try:
        yield prefect_server
    finally:
        # The automation watches every flow run of the server: other modules' runs beat every 180 s.
        async def delete(client):
            for automation in await client.read_automations_by_name(spec["automations"][0]["name"]):
                await client.delete_automation(automation.id)

        _read(prefect_server, delete)


def _worker(server, log: Path) -> subprocess.Popen:
    env = {**server.env, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)}
    return subprocess.Popen([PREFECT, "worker", "start", "--pool", POOL, "--type", "process"], env=env, cwd=ROOT,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


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


def _state_of(server, run_id: str, until, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        run = _read(server, lambda c: c.read_flow_run(run_id))
        if until(run.state) or time.monotonic() > deadline:
            return run
        time.sleep(2)


def test_a_killed_workers_run_is_marked_crashed_and_its_retry_trains_on_from_the_checkpoint(deployed, tiny_hidden_run,
                                                                                             tmp_path):
    root = tmp_path / "store"
    copy_tree(open_store(str(tiny_hidden_run.store_root)), "tiny/hidden", open_store(str(root)), "tiny/hidden")
    store = open_store(str(root))
    params = {"config": _config(root, tiny_hidden_run.target_dir), "hidden_manifest_uri": ""}
    first = _worker(deployed, tmp_path / "worker1.log")
    try:
        out = deployed.cli("deployment", "run", "train-drafter/train-drafter", "--params", json.dumps(params))
        run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", out.stdout + out.stderr).group(1)
        latest = "tiny/train/checkpoints/latest.json"
        deadline = time.monotonic() + 240
        while not store.exists(latest):
            assert time.monotonic() < deadline, "training wrote no checkpoint"
            time.sleep(0.05)
    finally:
        # A machine or pod that dies takes the worker and the flow run's processes at once: none of them can report.
        runs = _processes_of(run_id)
        os.killpg(first.pid, signal.SIGKILL)
        for pid in runs:
            os.kill(pid, signal.SIGKILL)
        kill_group(first)
    assert runs, "the flow run's process was not found"
    killed_at = json.loads(store.get_bytes(latest))["step"]
    assert killed_at < MAX_STEPS

    # The run stays Running without its process until the automation sees no heartbeat for WITHIN_S.
    started = time.monotonic()
    run = _state_of(deployed, run_id, lambda s: s.is_final(), WITHIN_S + 2 * HEARTBEAT_S + 60)
    crashed_after = time.monotonic() - started
    assert run.state.is_crashed(), f"{run.state.name}: {run.state.message}"
    assert "No heartbeat" in run.state.message and "prefect flow-run retry" in run.state.message

    second = _worker(deployed, tmp_path / "worker2.log")
    try:
        deployed.cli("flow-run", "retry", run_id)
        run = _state_of(deployed, run_id, lambda s: s.is_final() and not s.is_crashed(), 300)
    finally:
        kill_group(second)
    assert run.state.is_completed(), f"{run.state.name}: {run.state.message}"
    metrics = json.loads(store.get_bytes("tiny/train/metrics.json"))
    print(f"killed after the checkpoint at step {killed_at}, Crashed {crashed_after:.0f} s later; the retry resumed "
          f"from step {metrics.get('resumed_from')}")
    assert metrics["steps"] == MAX_STEPS
    assert killed_at <= metrics["resumed_from"] < MAX_STEPS
