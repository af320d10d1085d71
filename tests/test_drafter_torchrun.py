"""Training on several processes: two gloo ranks under torchrun train the same loss curve and checkpoint as one
process with the same global batch, and a run resumes on another process count where it stopped. From the flow: the
train-drafter task starts torchrun (2 ranks, gloo on CPU), its progress is the task's log in Prefect, and when a rank
is killed mid-training the task's retry resumes from the last checkpoint and finishes the requested steps. Real
torchrun, real Prefect server."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from prefect import flow
from prefect.settings import PREFECT_API_URL, temporary_settings

from draftline import stages
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


# ---------------------------------------------------------------- one process against two

CURVE_STEPS = 12  # checkpoints and validation at 6 and 12
# fp32 on the CPU. The two runs differ only in summation order: each rank sums its rows' losses and gradients, gloo
# adds the two sums, and a matmul over one row or two may block differently; each sum is exact to a few units of
# fp32's 2^-24 (6e-8). The logged figures (loss, validation loss, gradient norm) are such sums: measured within
# 1.2e-7 of each other, bounded here by 1e-5. Twelve AdamW steps carry the differences into the weights, where they
# grow: AdamW divides each gradient by its own running magnitude, so a weight whose gradient is near zero takes a
# step of the relative error of that gradient; measured 1.8e-5 of a tensor's largest weight, bounded by 1e-3. A
# gradient twice too large (averaged wrongly over ranks) would fail the gradient norms by 1.0 and a batch split
# wrongly the losses by percents.
CURVE_RTOL = 1e-5
WEIGHTS_RTOL = 1e-3


def _store_copy(tiny_hidden_run, root: Path) -> Path:
    copy_tree(open_store(str(tiny_hidden_run.store_root)), "tiny/hidden", open_store(str(root)), "tiny/hidden")
    return root


def _train(config: PipelineConfig) -> dict:
    """The training stage as the pipeline runs it: in this process for one, under torchrun for more."""
    lines: list[str] = []
    threads = torch.get_num_threads()
    try:
        return stages.train(config, open_store(config.store.root), on_line=lines.append)
    except TrainingError:
        print("\n".join(lines[-60:]))
        raise
    finally:
        torch.set_num_threads(threads)  # train.num_threads applies to this whole process


def _checkpoint(root: Path, step: int) -> dict:
    return torch.load(root / f"tiny/train/checkpoints/step-{step:08d}.pt", map_location="cpu", weights_only=False)


def _rewind(root: Path, step: int) -> None:
    """Make the checkpoint of `step` the newest, as if the run had stopped right after writing it."""
    store = open_store(str(root))
    prefix = "tiny/train/checkpoints"
    fingerprint = json.loads(store.get_bytes(f"{prefix}/latest.json"))["fingerprint"]
    for key in store.list(f"{prefix}/"):
        if key.endswith(".pt") and int(key.rsplit("-", 1)[1].split(".")[0]) > step:
            store.delete(key)
    store.put_bytes(f"{prefix}/latest.json", json.dumps(
        {"key": f"{prefix}/step-{step:08d}.pt", "step": step, "fingerprint": fingerprint}).encode())


@pytest.fixture(scope="module")
def curves(tiny_hidden_run, tmp_path_factory) -> dict:
    """The same training on one process and on two; then each rewound to its middle checkpoint and finished on the
    other count. Per count: (summary, final checkpoint, summary of the resumed run, its final checkpoint)."""
    out = {}
    for processes, other in ((1, 2), (2, 1)):
        root = _store_copy(tiny_hidden_run, tmp_path_factory.mktemp(f"curve-{processes}") / "store")
        config = _config(root, tiny_hidden_run.target_dir, processes=processes, max_steps=CURVE_STEPS,
                         checkpoint_every=CURVE_STEPS // 2, val_every=CURVE_STEPS // 2, keep_checkpoints=2)
        summary = _train(config)
        final = _checkpoint(root, CURVE_STEPS)
        _rewind(root, CURVE_STEPS // 2)
        resumed = _train(config.model_copy(update={"train": config.train.model_copy(update={"processes": other})}))
        out[processes] = (summary, final, resumed, _checkpoint(root, CURVE_STEPS))
    return out


def _curve(summary: dict) -> list[float]:
    return [e["loss"] for e in summary["history"]["train"]]


def _close(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two equally long curves."""
    assert len(a) == len(b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _weights_close(a: dict, b: dict) -> float:
    """The largest difference of two checkpoints' trained weights, relative to each tensor's largest value."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12))
               for k in b if b[k].is_floating_point() and k != "embed_tokens.weight")


def test_two_gloo_processes_train_the_curve_and_checkpoint_of_one_process(curves):
    (one, one_final, _, _), (two, two_final, _, _) = curves[1], curves[2]
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert [e["step"] for e in two["history"]["train"]] == list(range(1, CURVE_STEPS + 1))
    loss, val = _close(_curve(two), _curve(one)), _close([v["loss"] for v in two["history"]["val"]],
                                                          [v["loss"] for v in one["history"]["val"]])
    grads = _close([e["grad_norm"] for e in two["history"]["train"]], [e["grad_norm"] for e in one["history"]["train"]])
    weights = _weights_close(two_final["model"], one_final["model"])
    print(f"two processes against one: loss {loss:.2e}, validation {val:.2e}, gradient norm {grads:.2e}, "
          f"weights {weights:.2e} (relative)")
    assert max(loss, val, grads) <= CURVE_RTOL and weights <= WEIGHTS_RTOL
    # The loss moves by far more than the tolerance per step: equal curves are not two flat lines.
    assert min(abs(a - b) / a for a, b in zip(_curve(one), _curve(one)[1:])) > 10 * CURVE_RTOL
    assert two_final["step"] == one_final["step"] == CURVE_STEPS
    assert two_final["cursor"] == one_final["cursor"] and two_final["fingerprint"] == one_final["fingerprint"]


@pytest.mark.parametrize("processes", [2, 1], ids=["two-then-one", "one-then-two"])
def test_a_run_resumed_on_another_process_count_continues_its_curve(curves, processes):
    """Stopped after its middle checkpoint and finished on the other count: the first half is the stopped run's, the
    second half and the last checkpoint those of an uninterrupted run."""
    full, _, resumed, resumed_final = curves[processes]
    other = 3 - processes
    uninterrupted, uninterrupted_final = curves[other][0], curves[other][1]
    half = CURVE_STEPS // 2
    assert resumed["resumed_from"] == half and resumed["world_size"] == other
    assert _curve(resumed)[:half] == _curve(full)[:half]  # carried in the checkpoint, not recomputed
    loss = _close(_curve(resumed), _curve(uninterrupted))
    weights = _weights_close(resumed_final["model"], uninterrupted_final["model"])
    print(f"resumed on {other} process(es) against an uninterrupted run: loss {loss:.2e}, weights {weights:.2e}")
    assert loss <= CURVE_RTOL and weights <= WEIGHTS_RTOL
