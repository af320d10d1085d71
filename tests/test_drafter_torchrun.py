"""Training on several processes from the flow: the train-drafter task starts torchrun (2 ranks, gloo on CPU), its
progress is the task's log in Prefect, and when a rank is killed mid-training the task's retry resumes from the last
checkpoint and finishes the requested steps. Real torchrun, real Prefect server."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from prefect import flow
from prefect.settings import PREFECT_API_URL, temporary_settings

from draftline.config import PipelineConfig
from draftline.config_loading import parse_config
from draftline.errors import ConfigError, TrainingError
from draftline.store import copy_tree, open_store
from tasks.drafter import train_drafter

pytestmark = [pytest.mark.prefect]

MAX_STEPS = 40
CHECKPOINT_EVERY = 5


def _config(store_root: Path, target_dir: Path, **train) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "run": "tiny", "store": {"root": str(store_root)}, "target": {"path": str(target_dir)},
        # Training reads neither prompt file; the config needs them for the other stages.
        "traces": {"prompts": "assets/prompts/train_prompts.jsonl"},
        "eval": {"prompts": "assets/prompts/eval_prompts.jsonl"},
        "drafter": {"draft_vocab_size": 128},
        "train": {"ttt_steps": 3, "tokens_per_batch": 512, "max_seq_len": 256, "warmup_steps": 2,
                  "learning_rate": 3e-3, "val_fraction": 0.25, "num_threads": 1, "device": "cpu", "log_every": 1,
                  "max_steps": MAX_STEPS, "val_every": MAX_STEPS, "checkpoint_every": CHECKPOINT_EVERY,
                  "processes": 2, **train},
    })


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _rank_pid(rank: int) -> int | None:
    """The torchrun worker of this rank among this test's own descendants (the task runs in this process)."""
    for pid in _descendants(os.getpid()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={rank}".encode() in environ:
            return pid
    return None


def _task_run_and_logs(api_url: str, task_run_id) -> tuple:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId
    from prefect.client.schemas.sorting import LogSort

    async def read():
        # The server answers one page (200 logs by default) per request.
        async with get_client() as client:
            run = await client.read_task_run(task_run_id)
            messages: list[str] = []
            while True:
                page = await client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])),
                                              offset=len(messages), sort=LogSort.TIMESTAMP_ASC)
                messages += [log.message for log in page]
                if not page:
                    return run, messages

    from prefect.logging.handlers import APILogHandler

    with temporary_settings({PREFECT_API_URL: api_url}):
        APILogHandler().flush()  # logs reach the server in batches; send what is still queued
        return asyncio.run(read())


@pytest.fixture
def hidden_store(tiny_hidden_run, tmp_path) -> Path:
    """The tiny run's hidden-state shards in a store of this test's own, so no other test's training is resumed."""
    root = tmp_path / "store"
    copy_tree(open_store(str(tiny_hidden_run.store_root)), "tiny/hidden", open_store(str(root)), "tiny/hidden")
    return root


def test_a_rank_killed_mid_training_is_resumed_by_the_tasks_retry(prefect_server, tiny_hidden_run, hidden_store):
    config = _config(hidden_store, tiny_hidden_run.target_dir)
    store = open_store(str(hidden_store))
    latest = "tiny/train/checkpoints/latest.json"
    killed: dict = {}

    def kill_rank_1_after_the_first_checkpoint() -> None:
        deadline = time.monotonic() + 300
        while not store.exists(latest) and time.monotonic() < deadline:
            time.sleep(0.02)
        killed["checkpoint"] = json.loads(store.get_bytes(latest))["step"]
        pid = _rank_pid(1)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed["pid"] = pid

    @flow
    def train_only(config: PipelineConfig):
        return train_drafter(config, "", return_state=True)

    killer = threading.Thread(target=kill_rank_1_after_the_first_checkpoint, daemon=True)
    killer.start()
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        state = train_only(config)
    killer.join(timeout=10)
    assert "pid" in killed, "rank 1 was not found running after the first checkpoint"
    assert killed["checkpoint"] < MAX_STEPS

    task_run, messages = _task_run_and_logs(prefect_server.api_url, state.state_details.task_run_id)
    log = "\n".join(messages)
    assert state.is_completed(), f"{state.name}: {state.message}\n{log[-4000:]}"
    assert task_run.run_count == 2, log[-4000:]  # the killed attempt, then the retry
    assert "training with torchrun (2 processes) exited with status 1: rank 1 was killed by SIGKILL" in log

    summary = state.result()
    print(f"rank 1 killed after the checkpoint at step {killed['checkpoint']}; "
          f"the retry resumed from step {summary['resumed_from']}")
    # The retry continued from the checkpoint (not step 0) and finished the requested steps, each once.
    assert killed["checkpoint"] <= summary["resumed_from"] < MAX_STEPS
    assert summary["resumed_from"] % CHECKPOINT_EVERY == 0
    assert summary["steps"] == MAX_STEPS and summary["world_size"] == 2
    assert [e["step"] for e in summary["history"]["train"]] == list(range(1, MAX_STEPS + 1))
    assert json.loads(store.get_bytes("tiny/train/metrics.json"))["steps"] == MAX_STEPS
    assert store.read_manifest("tiny/train/drafter") is not None

    # The ranks' progress lines are the task's log in Prefect, from both attempts.
    assert f"step 1/{MAX_STEPS} loss" in log and f"step {MAX_STEPS}/{MAX_STEPS} loss" in log
    assert f"resumed from {store.uri('tiny/train/checkpoints')}/step-{summary['resumed_from']:08d}.pt" in log


def test_a_rank_refusing_its_input_fails_the_task_once_with_the_ranks_own_sentence(prefect_server, tiny_hidden_run,
                                                                                    hidden_store):
    """Bad input is not retried: the ranks' ConfigError is the failure's first line, after one attempt."""
    store = open_store(str(hidden_store))
    store.put_bytes("tiny/train/checkpoints/latest.json",
                    json.dumps({"key": "tiny/train/checkpoints/step-00000005.pt", "step": 5,
                                "fingerprint": "another-run"}).encode())

    @flow
    def train_only(config: PipelineConfig):
        return train_drafter(config, "", return_state=True)

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        state = train_only(_config(hidden_store, tiny_hidden_run.target_dir), return_state=True)
    task_state = state.result(raise_on_failure=False)
    assert task_state.is_failed()
    task_run, _ = _task_run_and_logs(prefect_server.api_url, task_state.state_details.task_run_id)
    assert task_run.run_count == 1
    with pytest.raises(TrainingError) as info:
        task_state.result()
    first_line = str(info.value).splitlines()[0]
    assert "ConfigError:" in first_line and "was written by a run with another config or data" in first_line
    assert "not retried" in first_line


def test_a_process_count_below_one_is_one_sentence_naming_the_field_and_the_fix():
    data = {"target": {"path": "assets/demo-llama"}, "traces": {"prompts": "p.jsonl"},
            "eval": {"prompts": "p.jsonl"}, "train": {"processes": 0}}
    with pytest.raises(ConfigError) as info:
        parse_config(data, PipelineConfig, "cfg.yaml")
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("cfg.yaml: train.processes=0 is invalid") and "set it to 1" in message
