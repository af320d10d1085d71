"""Online training's hand-off without vLLM: a stand-in for the capturing server writes each request's file as
draftline's connector does, with states that are a fixed function of the tokens. The engine side waits when the
buffer is full, the trainer reads sequences in the plan's order with their own states, a resumed trainer is fed
only what it has not trained, the epoch cache spares the engine, an engine failure stops the trainer naming the
engine side, and a short training through the library keeps no hidden states but the validation's."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from draftline.config import PipelineConfig, ServerSettings
from draftline.drafter.data import Cursor
from draftline.errors import ConfigError, EngineError
from draftline.online import engine as engine_side
from draftline.online.plan import OnlinePlan, epoch_order, split_traces
from draftline.online.source import EngineWatch, OnlineStream, SpoolReader, hand_off_folder, online_plan
from draftline.online.spool import ENGINE, TRAINER, WANT, listing, occupancy, request_key, reset, write_json
from draftline.safetensors_io import map_safetensors, write_safetensors
from draftline.store import open_store

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "assets" / "demo-llama"
HIDDEN, VOCAB = 256, 4096


def write_random_traces(store, run: str, count: int = 24, seed: int = 0) -> None:
    """Traces of random tokens (8 prompt tokens, 12-40 answer tokens) in two shards, with their manifest."""
    g = torch.Generator().manual_seed(seed)
    lines = []
    for i in range(count):
        n = int(torch.randint(12, 41, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (8 + n,), generator=g).tolist()
        lines.append(json.dumps({"id": f"t{i}", "prompt_id": f"p{i}", "input_ids": ids,
                                 "loss_mask": [0] * 8 + [1] * n, "text": ""}))
    half = count // 2
    entries = [store.put_bytes(f"{run}/traces/shard-{s:05d}.jsonl", ("\n".join(part) + "\n").encode())
               for s, part in enumerate([lines[:half], lines[half:]])]
    store.write_manifest(f"{run}/traces", entries)


@functools.lru_cache(maxsize=1)
def _table() -> torch.Tensor:
    return torch.randn(VOCAB, 4 * HIDDEN, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)


def states_of(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stand-in engine's states: rows of a fixed random table, indexed by token (aux [n, 3H], last [n, H])."""
    rows = _table()[ids]
    return rows[:, :3 * HIDDEN].contiguous(), rows[:, 3 * HIDDEN:].contiguous()


class FakeClient:
    """extract_vllm.SpoolClient's interface, answered by writing the file draftline's connector would write."""

    def __init__(self, base_url, folder, workers=4, storage="bf16", delay_s: float = 0.0):
        self.folder, self.storage, self.delay_s = Path(folder), storage, delay_s
        self.requested: list[str] = []
        self.pool = ThreadPoolExecutor(max_workers=workers)

    fail_after: int | None = None  # requests answered before the stand-in fails for good
    die_once_after: int | None = None  # requests answered before the first stand-in server dies (a restart helps)
    died: list[bool] = []

    def request(self, key: str, token_ids: list[int]) -> None:
        time.sleep(self.delay_s)
        if self.fail_after is not None and len(self.requested) >= self.fail_after:
            raise EngineError("the stand-in engine died", transient=False)
        if self.die_once_after is not None and len(self.requested) >= self.die_once_after and not self.died:
            self.died.append(True)
            raise EngineError("the stand-in server stopped answering", transient=True)
        ids = torch.tensor(token_ids, dtype=torch.int64)
        aux, last = states_of(ids)
        path = self.folder / f"{key}.safetensors"
        tmp = f"{path}.tmp-{os.getpid()}"
        write_safetensors(tmp, {"aux_hidden_states": aux, "last_hidden_states": last, "token_ids": ids},
                          {"storage": self.storage})
        os.replace(tmp, path)
        self.requested.append(key)

    def capture(self, key: str, token_ids: list[int]) -> dict:
        self.request(key, token_ids)
        path = self.folder / f"{key}.safetensors"
        data, _ = map_safetensors(str(path))
        os.remove(path)
        return {n: data[n] for n in ("aux_hidden_states", "last_hidden_states")}

    def submit(self, key, token_ids):
        return self.pool.submit(self.capture, key, token_ids)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class FakeFeed(engine_side.EngineFeed):
    """The engine side with the stand-in client in place of a vLLM server."""

    clients: list[FakeClient] = []

    def __init__(self, *args, delay_s: float = 0.0, **kwargs):
        def client(*a, **k):
            made = FakeClient(*a, **k, delay_s=delay_s)
            FakeFeed.clients.append(made)
            return made
        super().__init__(*args, client=client, **kwargs)

    def _server(self, plan, identity):
        @contextlib.contextmanager
        def start():
            yield "http://stand-in"

        return ServerSettings(retries=2), start


def make_config(tmp_path: Path, **online) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "run": "o", "store": {"root": str(tmp_path / "store")}, "target": {"path": str(TARGET)},
        "traces": {"prompts": str(ROOT / "assets/prompts/train_prompts.jsonl")},
        "extract": {"requests_in_flight": 4, "tokens_per_shard": 128},
        "drafter": {"draft_vocab_size": 256},
        "train": {"source": "engine", "val_fraction": 0.0, "tokens_per_batch": 96, "max_seq_len": 32, "ttt_steps": 2,
                  "max_steps": 4, "warmup_steps": 1, "val_every": 2, "checkpoint_every": 2, "num_threads": 1,
                  "device": "cpu", "log_every": 1,
                  "online": {"spool_dir": str(tmp_path / "shm"), "wait_s": 60, **online}},
        "eval": {"prompts": str(ROOT / "assets/prompts/eval_prompts.jsonl"), "engines": []},
    })


@pytest.fixture
def setup(tmp_path):
    config = make_config(tmp_path)
    store = open_store(config.store.root)
    write_random_traces(store, config.run)
    return config, store


def start_feed(config, store, **kwargs) -> tuple[FakeFeed, threading.Thread, dict]:
    reset(hand_off_folder(config))
    feed, out = FakeFeed(config, store, **kwargs), {}

    def run():
        try:
            out["result"] = feed.run()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return feed, thread, out


def open_reader(config, store, plan: OnlinePlan, start: int = 0, generation: int = 0, cache: int = 0) -> SpoolReader:
    folder = hand_off_folder(config)
    write_json(folder / WANT, {"generation": generation, "plan": plan.fingerprint, "start": start,
                               "cache_tokens": cache})
    return SpoolReader(folder, plan, "bf16", EngineWatch(folder, 30.0), generation, cache)


def wait_until(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def stop(config, feed, thread) -> None:
    write_json(hand_off_folder(config) / TRAINER, {"state": "finished", "time": time.time()})
    feed.stop()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_the_plan_holds_out_the_last_traces_and_orders_each_epoch_by_the_seed(setup):
    assert split_traces([10, 10, 10, 10], 0.25) == ([0, 1, 2], [3])
    assert split_traces([10, 10, 10, 10], 0.3) == ([0, 1], [2, 3])
    assert split_traces([10, 10], 0.99) == ([0], [1])  # one trace stays in training
    assert split_traces([10], 0.5) == ([0], [])
    assert split_traces([10, 10], 0.0) == ([0, 1], [])
    assert epoch_order(20, 0, 1) == epoch_order(20, 0, 1) != epoch_order(20, 0, 2)
    config, store = setup
    plan = online_plan(config.model_copy(update={"train": config.train.model_copy(update={"val_fraction": 0.2})}),
                       store)
    assert plan.val == list(range(plan.val[0], 24)) and plan.train == list(range(plan.val[0]))
    n = len(plan.train)
    assert sorted(plan.trace_of(o) for o in range(n)) == plan.train  # every trace once an epoch
    assert [plan.trace_of(o) for o in range(n, 2 * n)] == plan.order(1) != plan.order(0)
    assert all(plan.tokens(t) == min(plan.length(t), 32) for t in plan.train)


def test_the_engine_waits_when_the_buffer_is_full_and_goes_on_as_the_trainer_reads(tmp_path):
    config = make_config(tmp_path, buffer_tokens=100)
    store = open_store(config.store.root)
    write_random_traces(store, config.run)
    plan = online_plan(config, store)
    feed, thread, out = start_feed(config, store)
    folder = hand_off_folder(config)
    try:
        reader = open_reader(config, store, plan)
        wait_until(lambda: feed.stats["sequences_sent"] >= 3)
        sent = feed.stats["sequences_sent"]
        time.sleep(0.5)  # time to send many more, were the bound not kept
        assert feed.stats["sequences_sent"] == sent < len(plan.train)
        wait_until(lambda: len([f for f in listing(folder) if f.complete]) == sent)
        assert occupancy(folder, 0) <= 100
        for o in range(sent):  # the trainer reads what is there: the engine sends more
            reader.sequence(o, plan.trace_of(o))
        wait_until(lambda: feed.stats["sequences_sent"] > sent)
        assert occupancy(folder, 0) <= 100
    finally:
        stop(config, feed, thread)
    assert "error" not in out and out["result"]["backpressure_s"] > 0


def test_the_trainer_reads_the_plans_order_with_each_sequences_own_states(setup):
    config, store = setup
    plan = online_plan(config, store)
    feed, thread, _ = start_feed(config, store)
    try:
        stream = OnlineStream(open_reader(config, store, plan), 96, Cursor())
        seen = []
        while stream.cursor.epoch < 1 or stream.cursor.seq < 4:  # into the second epoch
            batch = stream.next_batch()
            assert 0 < sum(len(s) for s in batch) <= 96 or len(batch) == 1
            for s in batch:
                seen.append(s.trace)
                assert s.input_ids.tolist() == plan.trace_tokens(s.trace)
                assert torch.equal(s.loss_mask, plan.trace_mask(s.trace))
                aux, last = states_of(s.input_ids)
                assert torch.equal(s.aux, aux) and torch.equal(s.last, last)
        n = len(plan.train)
        assert len(seen) > n and seen[:n] == plan.order(0) and seen[n:] == plan.order(1)[:len(seen) - n]
        assert stream.cursor.epoch == 1
    finally:
        stop(config, feed, thread)


def test_a_resumed_trainer_is_fed_only_what_it_has_not_trained(setup):
    config, store = setup
    plan = online_plan(config, store)
    FakeFeed.clients.clear()
    feed, thread, _ = start_feed(config, store)
    try:
        # Generation 3 resumes at position 7 of epoch 1, as a trainer restarted from a checkpoint does.
        cursor = Cursor(epoch=1, seq=7)
        stream = OnlineStream(open_reader(config, store, plan, start=plan.ordinal(1, 7), generation=3), 96, cursor)
        batch = stream.next_batch()
        assert [s.trace for s in batch] == plan.order(1)[7:7 + len(batch)]
        [s.aux for s in batch]
    finally:
        stop(config, feed, thread)
    keys = FakeFeed.clients[-1].requested
    assert keys and all(k.startswith("g0003-") for k in keys)
    assert min(int(k.split("-o")[1][:12]) for k in keys) == plan.ordinal(1, 7)


def test_the_epoch_cache_spares_the_engine_the_epochs_after_the_first(tmp_path):
    config = make_config(tmp_path, epoch_cache_tokens=10**6)
    store = open_store(config.store.root)
    write_random_traces(store, config.run)
    plan = online_plan(config, store)
    FakeFeed.clients.clear()
    feed, thread, _ = start_feed(config, store, delay_s=0.02)
    try:
        reader = open_reader(config, store, plan, cache=10**6)
        stream = OnlineStream(reader, 96, Cursor())
        while stream.cursor.epoch < 2:
            for s in stream.next_batch():
                assert torch.equal(s.aux, states_of(s.input_ids)[0])
    finally:
        stop(config, feed, thread)
    n = len(plan.train)
    ordinals = [int(k.split("-o")[1][:12]) for k in FakeFeed.clients[-1].requested]
    assert sorted(ordinals) == list(range(n))  # the first epoch once; the later ones from the trainer's memory
    assert len(reader.cache) == n


def test_an_engine_failure_stops_the_trainer_naming_the_engine_side(setup):
    config, store = setup
    plan = online_plan(config, store)
    folder = hand_off_folder(config)
    reset(folder)
    reader = open_reader(config, store, plan)
    write_json(folder / ENGINE, {"state": "failed", "time": time.time(),
                                 "error": "vllm-capture failed to start after 3 attempt(s): out of memory"})
    with pytest.raises(EngineError, match="engine side of online training failed.*out of memory") as info:
        reader.sequence(0, plan.trace_of(0))
    assert not info.value.transient
    write_json(folder / ENGINE, {"state": "feeding", "time": time.time() - 100})
    quiet = SpoolReader(folder, plan, "bf16", EngineWatch(folder, 1.0), 0)
    with pytest.raises(EngineError, match="gave no sign of life"):
        quiet.sequence(0, plan.trace_of(0))
    # A file of another run's tokens under this run's name is refused rather than trained on.
    other = plan.train[1] if plan.trace_tokens(plan.train[1]) != plan.trace_tokens(plan.trace_of(0)) else plan.train[2]
    FakeClient(None, folder).request(request_key(0, 0, plan.tokens(plan.trace_of(0))), plan.trace_tokens(other))
    write_json(folder / ENGINE, {"state": "feeding", "time": time.time()})
    with pytest.raises(EngineError, match="belong to other tokens"):
        reader.sequence(0, plan.trace_of(0))


def test_online_training_through_the_library_keeps_only_the_validations_states_and_resumes(tmp_path, monkeypatch):
    from draftline.online.run import train_online

    config = make_config(tmp_path, buffer_tokens=100)  # the engine runs about one batch ahead
    config = config.model_copy(update={"train": config.train.model_copy(update={"val_fraction": 0.2, "max_steps": 6})})
    store = open_store(config.store.root)
    write_random_traces(store, config.run)
    monkeypatch.setattr(engine_side, "EngineFeed", FakeFeed)
    FakeFeed.clients.clear()
    monkeypatch.setattr(FakeClient, "fail_after", 16, raising=False)
    with pytest.raises(EngineError, match="the stand-in engine died"):
        train_online(config, store)
    root = Path(config.store.root) / config.run
    latest = json.loads((root / "train/checkpoints/latest.json").read_text())
    assert 0 < latest["step"] < 6
    cursor = torch.load(root / latest["key"].split("/", 1)[1], weights_only=False)["cursor"]
    # The rerun resumes from the last checkpoint and asks the engine only for the sequences after it; the validation
    # captured first is kept, not captured again.
    monkeypatch.setattr(FakeClient, "fail_after", None, raising=False)
    FakeFeed.clients.clear()
    summary = train_online(config, store)
    assert summary["resumed_from"] == latest["step"] and summary["steps"] == 6 and summary["source"] == "engine"
    assert summary["final_val"]["tokens"] > 0 and summary["engine"]["trainer"] == "finished"
    plan = online_plan(config, store)
    requested = [k for c in FakeFeed.clients for k in c.requested]
    assert requested and not any(k.startswith("v") for k in requested)
    ordinals = [int(k.split("-o")[1][:12]) for k in requested]
    assert min(ordinals) == plan.ordinal(cursor["epoch"], cursor["seq"]) > 0
    final = torch.load(root / "train/checkpoints/step-00000006.pt", weights_only=False)["cursor"]
    assert max(ordinals) < plan.ordinal(final["epoch"], final["seq"])  # nothing captured beyond the last step
    assert not (root / "hidden").exists()
    states = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.safetensors"))
    assert states[-1] == "train/drafter/model.safetensors" and len(states) > 2
    assert all(s.startswith("hidden-val/shard-") for s in states[:-1])
    assert not hand_off_folder(config).exists()  # the hand-off folder goes with the session


def kimi_shaped_target(folder: Path) -> Path:
    """Kimi-K2.5's text sizes over the demo Kimi's config, and a sparse file as large as its INT4 weights (595 GB):
    what the placement preflight reads, without the model."""
    cfg = json.loads((ROOT / "assets/demo-kimi/config.json").read_text())
    cfg["text_config"].update(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                              num_attention_heads=64, num_key_value_heads=64, num_hidden_layers=61, vocab_size=163840,
                              q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                              v_head_dim=128, head_dim=192, n_routed_experts=384)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(595 * 10**9)
    return folder


def test_the_preflight_places_both_sides_on_the_gpus_and_refuses_what_cannot_fit(tmp_path):
    from draftline.config_loading import load_config
    from draftline.online.engine import online_server_settings
    from draftline.online.placement import GIB, check_placement
    from draftline.stages import stage_gpus

    h200 = int(139.8 * GIB)
    # Kimi-K2.5 on one 8-GPU worker as configs/kimi-k2.5.yaml plans it: the engine at TP 8 keeps 0.70 of each GPU,
    # the 8 training ranks share them; at vLLM's usual 0.9 the trainer would not fit.
    kimi = load_config(ROOT / "configs/kimi-k2.5.yaml", overrides={
        "target": {"path": str(kimi_shaped_target(tmp_path / "kimi"))}, "train": {"source": "engine"},
        # The public Kimi-K2.5 drafter's layer, which the warm start takes.
        "drafter": {"intermediate_size": 12288, "num_attention_heads": 64, "num_key_value_heads": 64}})
    assert "trainer on GPUs [0, 1, 2, 3, 4, 5, 6, 7]" in check_placement(kimi, visible=8, gpu_bytes=h200)
    assert stage_gpus(kimi, "train") == 8
    server = online_server_settings(kimi)
    assert server.extra_args.count("--gpu-memory-utilization") == 1 and server.extra_args[-1] == "0.7"

    def online(config, **fields):
        return config.model_copy(update={"train": config.train.model_copy(update={
            "online": config.train.online.model_copy(update=fields)})})

    with pytest.raises(ConfigError, match=r"engine_memory_fraction to at most 0\.\d\d"):
        check_placement(online(kimi, engine_memory_fraction=0.9), visible=8, gpu_bytes=h200)
    with pytest.raises(ConfigError, match="cannot hold its .* GiB of weights"):
        check_placement(online(kimi, engine_memory_fraction=0.4), visible=8, gpu_bytes=h200)
    with pytest.raises(ConfigError, match="the engine needs 8 GPUs"):
        check_placement(online(kimi, engine_devices=[0, 1, 2, 3]), visible=8, gpu_bytes=h200)
    with pytest.raises(ConfigError, match=r"trainer_devices=\[8\] must name distinct GPUs"):
        check_placement(online(kimi, trainer_devices=[8]), visible=8, gpu_bytes=h200)
    # Sides of their own (16 GPUs: the engine on 8, the trainer on 8): no sharing, the GPUs of both counted.
    apart = online(kimi, engine_devices=list(range(8)), trainer_devices=list(range(8, 16)), engine_memory_fraction=0.9)
    assert "trainer on GPUs [8, 9" in check_placement(apart, visible=16, gpu_bytes=h200)
    assert stage_gpus(apart, "train") == 16
    assert online_server_settings(apart).env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    # The demo on one 80 GB GPU fits at vLLM's own share; on a machine without GPUs there is nothing to place.
    demo = load_config(ROOT / "configs/demo.yaml", overrides={"train": {"source": "engine"}})
    assert check_placement(demo, visible=1, gpu_bytes=80 * GIB)
    assert check_placement(demo, visible=0) is None


def test_an_engine_that_dies_mid_feed_is_restarted_and_the_training_goes_on(tmp_path, monkeypatch):
    from draftline.online.run import train_online

    config = make_config(tmp_path, buffer_tokens=100)
    store = open_store(config.store.root)
    write_random_traces(store, config.run)
    monkeypatch.setattr(engine_side, "EngineFeed", FakeFeed)
    monkeypatch.setattr(FakeClient, "die_once_after", 6, raising=False)
    monkeypatch.setattr(FakeClient, "died", [], raising=False)
    FakeFeed.clients.clear()
    summary = train_online(config, store)
    assert summary["engine"]["restarts"] == 1 and summary["steps"] == 4 and FakeClient.died
    assert len(FakeFeed.clients) == 2  # a second server, which resumed where the trainer was
    first, second = ([int(k.split("-o")[1][:12]) for k in c.requested] for c in FakeFeed.clients)
    assert min(second) <= max(first) + 1


def test_a_pipeline_that_trains_online_needs_no_extraction_stage(setup):
    from flows.deployed import STAGE_DEPLOYMENTS, deployments_needed

    config, _ = setup
    online = deployments_needed(config, "in-process", "deployments")
    offline = deployments_needed(config.model_copy(update={"train": config.train.model_copy(update={
        "source": "shards"})}), "in-process", "deployments")
    assert offline == list(STAGE_DEPLOYMENTS)
    assert online == [d for d in STAGE_DEPLOYMENTS if not d.startswith("extract-hidden-states/")]


@pytest.mark.prefect
def test_the_flow_names_the_side_that_failed(prefect_server, tmp_path, monkeypatch):
    """The train-drafter-online flow with the stand-in engine: an engine that fails fails the flow with its own error
    (both tasks failed); a trainer that fails fails it with the trainer's, and the engine's task ends cancelled."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from draftline.drafter import train as train_lib
    from flows.stages import train_online
    from tests.test_online_training import _task_runs

    config = make_config(tmp_path)
    store = open_store(config.store.root)
    write_random_traces(store, config.run)
    monkeypatch.setattr(engine_side, "EngineFeed", FakeFeed)
    monkeypatch.setattr(FakeClient, "fail_after", 0, raising=False)
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        with pytest.raises(EngineError, match="the stand-in engine died"):
            train_online(config)
    assert _task_runs(prefect_server.api_url, "train-drafter-online") == {"online-engine": "Failed",
                                                                          "online-trainer": "Failed"}
    monkeypatch.setattr(FakeClient, "fail_after", None, raising=False)

    def refuse(*args, **kwargs):
        raise ConfigError("the trainer refuses its input")

    monkeypatch.setattr(train_lib, "train_drafter", refuse)
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        with pytest.raises(ConfigError, match="the trainer refuses its input"):
            train_online(config)
    assert _task_runs(prefect_server.api_url, "train-drafter-online") == {"online-engine": "Cancelled",
                                                                          "online-trainer": "Failed"}


def two_machines(tmp_path: Path, s3_uri: str) -> tuple[PipelineConfig, PipelineConfig]:
    """One config with hand_off store as the engine's machine and the trainer's see it: each with its own folder."""
    base = make_config(tmp_path, buffer_tokens=100, hand_off="store")

    def machine(folder: str) -> PipelineConfig:
        online = base.train.online.model_copy(update={"spool_dir": str(tmp_path / folder)})
        return base.model_copy(update={"store": base.store.model_copy(update={"root": s3_uri}),
                                       "train": base.train.model_copy(update={"online": online})})

    return machine("engine-shm"), machine("trainer-shm")


def engine_machine(config: PipelineConfig, store) -> tuple[FakeFeed, threading.Thread, dict]:
    """The engine side (the stand-in client) running as on its own machine, in a thread; its result or error in out."""
    from draftline.online.run import run_engine

    feed, out = FakeFeed(config, store), {}

    def run():
        try:
            out["result"] = run_engine(config, store, feed=feed)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return feed, thread, out


def test_online_training_hands_off_through_s3_between_two_machines_folders(s3_uri, tmp_path):
    """train.online.hand_off store: the engine side and the trainer each with its own folder (as on two machines),
    the states crossing through real S3; the training completes and the store keeps none of them."""
    from draftline.online.relay import online_prefix
    from draftline.online.run import clean_up, prepare, run_trainer

    engine_config, trainer_config = two_machines(tmp_path, s3_uri)
    base = engine_config
    store = open_store(s3_uri)
    write_random_traces(store, base.run)
    prepare(engine_config)
    prepare(trainer_config)
    FakeFeed.clients.clear()
    feed, thread, out = engine_machine(engine_config, store)
    try:
        summary = run_trainer(trainer_config, store)
    except BaseException:
        feed.stop()
        raise
    finally:
        thread.join(timeout=60)  # the engine side stops once the trainer's word crossed the store
    assert "error" not in out and out["result"]["trainer"] == "finished"
    assert summary["steps"] == 4 and summary["source"] == "engine"
    # The engine wrote into its own folder and waited for the trainer to consume files through the store.
    assert FakeFeed.clients[0].folder == hand_off_folder(engine_config, "engine") != hand_off_folder(trainer_config)
    assert out["result"]["backpressure_s"] > 0
    assert store.list(online_prefix(base.run)) == []
    clean_up(engine_config)
    clean_up(trainer_config)
    assert not hand_off_folder(engine_config, "engine").exists() and not hand_off_folder(trainer_config).exists()


def test_a_failed_engine_through_the_store_leaves_no_states_there_and_the_rerun_resumes(s3_uri, tmp_path, monkeypatch):
    from draftline.online.relay import online_prefix
    from draftline.online.run import train_online

    config = make_config(tmp_path, buffer_tokens=100, hand_off="store")
    config = config.model_copy(update={"store": config.store.model_copy(update={"root": s3_uri}),
                                       "train": config.train.model_copy(update={"max_steps": 6})})
    store = open_store(s3_uri)
    write_random_traces(store, config.run)
    monkeypatch.setattr(engine_side, "EngineFeed", FakeFeed)
    monkeypatch.setattr(FakeClient, "fail_after", 12, raising=False)
    with pytest.raises(EngineError, match="the stand-in engine died"):
        train_online(config, store)
    assert not [k for k in store.list(config.run) if "/online/" in k]
    latest = json.loads(store.get_bytes(f"{config.run}/train/checkpoints/latest.json"))
    assert 0 < latest["step"] < 6
    # The rerun resumes from the last checkpoint and asks the engine again, through the store, for what follows it.
    monkeypatch.setattr(FakeClient, "fail_after", None, raising=False)
    summary = train_online(config, store)
    assert summary["resumed_from"] == latest["step"] and summary["steps"] == 6
    assert summary["engine"]["trainer"] == "finished" and store.list(online_prefix(config.run)) == []


def _config_file(config: PipelineConfig, path: Path) -> str:
    import yaml

    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return str(path)


def test_the_online_commands_refuse_a_config_whose_sides_cannot_be_on_two_machines(tmp_path, capsys):
    from draftline.cli import main

    local = _config_file(make_config(tmp_path), tmp_path / "local.yaml")
    assert main(["online", "engine", local]) == 2
    err = capsys.readouterr().err
    assert "train.online.hand_off: store" in err and "`draftline train` runs both sides" in err


def test_the_trainer_command_trains_from_an_engine_side_on_another_machine_through_s3(s3_uri, tmp_path, capsys):
    """`draftline online prepare` and `draftline online trainer` with the trainer's own folder, fed by an engine side
    that writes into another folder: the drafter is trained and checkpointed in the store, no states stay there."""
    from draftline.cli import main
    from draftline.online.relay import online_prefix
    engine_config, trainer_config = two_machines(tmp_path, s3_uri)
    base = engine_config
    store = open_store(s3_uri)
    write_random_traces(store, base.run)
    trainer_file = _config_file(trainer_config, tmp_path / "trainer.yaml")
    assert main(["online", "prepare", trainer_file]) == 0
    feed, thread, out = engine_machine(engine_config, store)
    try:
        assert main(["online", "trainer", trainer_file]) == 0
    except BaseException:
        feed.stop()
        raise
    finally:
        thread.join(timeout=60)  # the engine side stops once the trainer's word crossed the store
    assert "trainer done: 4 steps" in capsys.readouterr().out
    assert "error" not in out and out["result"]["trainer"] == "finished"
    assert any(key.startswith(f"{base.run}/train/") for key in store.list(f"{base.run}/train/"))
    assert store.list(online_prefix(base.run)) == []
