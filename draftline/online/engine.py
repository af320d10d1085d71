"""The engine side of online training: one supervised capturing vLLM server that captures the validation's states
first (kept as shards in `<run>/hidden-val/`), then every training sequence from where the trainer asks, as far
ahead as train.online.buffer_tokens allows, until the trainer is done; a server that dies mid-feed is restarted."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from draftline.config import PipelineConfig, ServerSettings
from draftline.errors import ConfigError, EngineError
from draftline.hidden_shards import finalize_hidden_states, length_buckets, shard_spec, trace_entries, write_hidden_shard
from draftline.layout import HELD_OUT_STAGE, train_prefix
from draftline.online.plan import EpochCache, OnlinePlan
from draftline.online.source import hand_off_folder, online_plan, plan_identity
from draftline.online.spool import (ENGINE, FAILED, FEEDING, FINISHED, STOPPED, TRAINER, WANT, Status, occupancy,
                                    read_json, request_key, sweep)
from draftline.progress import progress_step
from draftline.shards import finished_shard

HEARTBEAT_S = 2.0
SWEEP_EVERY_S = 2.0
REPORT_EVERY_S = 30.0  # how often the engine side logs what it captured
log = logging.getLogger("draftline.online.engine")


def online_server_settings(config: PipelineConfig) -> ServerSettings:
    """extract.vllm's server with online training's placement: its share of a shared GPU, and its GPUs."""
    settings = config.extract.vllm.resolved(config.target.dtype)
    online = config.train.online
    extra, env = list(settings.extra_args), dict(settings.env)
    if online.engine_memory_fraction is not None:  # it replaces the server's own flag: the preflight checked this one
        flag = "--gpu-memory-utilization"
        kept = []
        for i, a in enumerate(extra):
            if a.startswith(flag + "=") or a == flag or (i and extra[i - 1] == flag):
                continue
            kept.append(a)
        extra = kept + [flag, str(online.engine_memory_fraction)]
    if online.engine_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in online.engine_devices)
    return settings.model_copy(update={"extra_args": extra, "env": env})


class EngineFeed:
    """Runs the engine side until the trainer is done (or stop() is called); its status file tells the trainer what
    it does, and a failure there names the engine side."""

    def __init__(self, config: PipelineConfig, store, log_dir: str | Path | None = None,
                 say: Callable[[str], None] | None = None, client: Callable | None = None):
        """client(base_url, folder, workers, storage): what sends capture requests (extract_vllm.SpoolClient)."""
        self.config, self.store, self.log_dir = config, store, log_dir
        self.client = client
        self.folder = hand_off_folder(config, "engine")
        self.say = say or (lambda msg: None)
        self.status = Status(self.folder / ENGINE, every_s=0.0)
        self.stats: dict = {"sequences_sent": 0, "tokens_sent": 0, "backpressure_s": 0.0, "restarts": 0}
        self.trainer_state: str | None = None
        self._stop = threading.Event()
        self._fields: dict = {"state": "starting"}
        self._lock = threading.Lock()
        self._generation: int | None = None
        self._next = 0
        self._want: dict | None = None
        self._keeps: EpochCache | None = None

    def stop(self) -> None:
        self._stop.set()

    def _set(self, **fields) -> None:
        with self._lock:
            self._fields.update(fields)
            self.status.set(self._fields["state"], **{k: v for k, v in self._fields.items() if k != "state"},
                            sent=self.stats["sequences_sent"])

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if self._fields["state"] in (FAILED, STOPPED):
                return
            self._set()

    def run(self) -> dict:
        """Serve until the trainer is done; returns what was captured and how long the engine waited for room."""
        self.folder.mkdir(parents=True, exist_ok=True)
        beat = threading.Thread(target=self._heartbeat, daemon=True, name="draftline-engine-heartbeat")
        self._set(state="starting")
        beat.start()
        try:
            identity = plan_identity(self.config)
            plan = online_plan(self.config, self.store, identity)
            self._set(plan=plan.fingerprint)
            self._serve(plan, identity)
        except BaseException as exc:
            self._set(state=FAILED, error=str(exc).split("\n", 1)[0] or type(exc).__name__)
            raise
        finally:
            self._stop.set()
        self._set(state=STOPPED)
        return {**self.stats, "trainer": self.trainer_state}

    # ---------------------------------------------------------------- the server

    def _server(self, plan: OnlinePlan, identity: dict) -> tuple[ServerSettings, Callable]:
        """The server's settings, checked (GPUs, architecture, context length), and how to start one: a context
        manager that gives its base URL and stops it on leaving."""
        from draftline.engines.launch import launch
        from draftline.engines.vllm import capture_server_spec
        from draftline.extract_vllm import _max_model_len, check_architecture, check_devices, write_final_norm
        from draftline.target import num_layers

        config, target = self.config, self.config.target.path
        settings = online_server_settings(config)
        check_devices(settings, "extract.vllm")
        check_architecture(target, settings)
        longest = max([plan.length(t) for t in plan.val] + [plan.tokens(t) for t in plan.train])
        max_len = _max_model_len(settings, longest, target)
        layers = identity["aux"] + [num_layers(target)]
        spec = capture_server_spec(settings, Path(target), layers, self.folder, max_len,
                                   write_final_norm(target, self.folder))
        logs = Path(self.log_dir) if self.log_dir else self.folder / "engine-logs"  # the store keeps a copy

        @contextmanager
        def start():
            self.say(f"starting vLLM to capture layers {layers} of {target} for online training")
            with launch(spec, settings, logs, store=self.store,
                        log_key_prefix=f"{train_prefix(config.run)}/engine-logs") as server:
                yield server.base_url

        return settings, start

    def _serve(self, plan: OnlinePlan, identity: dict) -> None:
        settings, start = self._server(plan, identity)
        for attempt in range(settings.retries + 1):
            if (read_json(self.folder / TRAINER) or {}).get("state") in (FINISHED, FAILED):
                self.trainer_state = read_json(self.folder / TRAINER)["state"]
                return  # the trainer ended (or was served from a cache) before this server was needed
            served = False
            try:
                started = time.perf_counter()
                with start() as base_url:
                    served = True
                    self.stats.setdefault("engine_start_s", round(time.perf_counter() - started, 3))
                    self.say(f"vLLM ready after {time.perf_counter() - started:.0f} s")
                    self.feed(base_url, plan, identity)
                    return
            except EngineError as exc:
                # A server that served and then died is restarted (its start has its own retries); the trainer waits.
                if not (served and exc.transient) or attempt == settings.retries or self._stop.is_set():
                    raise
                self.stats["restarts"] += 1
                self.say(f"the capturing vLLM server failed mid-feed ({str(exc).splitlines()[0]}); restarting it")

    def feed(self, base_url: str, plan: OnlinePlan, identity: dict) -> None:
        """Through one server: the validation's states, then training sequences until the trainer is done."""
        from draftline.extract_vllm import SpoolClient

        extract = self.config.extract
        make = self.client or SpoolClient
        client = make(base_url, self.folder, workers=extract.requests_in_flight, storage=extract.storage)
        try:
            self._capture_validation(client, plan, identity)
            self._feed(client, plan)
        finally:
            client.close()

    def _capture_validation(self, client, plan: OnlinePlan, identity: dict) -> None:
        """The validation's states as shards in `<run>/hidden-val/`, captured before any training sequence and kept,
        so that every validation of the run (and of a resumed one) reads the same states."""
        from draftline.extract_vllm import CapturedTarget, assemble_shard
        from draftline.target import read_target_config

        if not plan.val:
            self._set(state=FEEDING, validation="none")
            return
        config, store, run = self.config, self.store, self.config.run
        text = read_target_config(config.target.path)
        source = CapturedTarget(identity["target"], identity["aux"], int(text.get("text_config", text)["hidden_size"]),
                                f"torch.{identity['dtype']}", storage=config.extract.storage)
        shards = plan.val_shards(config.extract.tokens_per_shard)
        trace_sha = {e.key: e.sha256 for e in trace_entries(store, run)}
        self._set(state="validation")
        started = time.perf_counter()
        for shard in shards:
            spec = shard_spec(source, shard, trace_sha)
            if finished_shard(store, run, HELD_OUT_STAGE, shard.index, spec) is not None:
                continue
            traces = plan.val_traces(shard)
            futures = [client.submit(f"v{shard.index:05d}-{j:06d}", t["input_ids"]) for j, t in enumerate(traces)]
            states = [f.result() for f in futures]
            order = [k for batch in length_buckets([len(t["input_ids"]) for t in traces],
                                                   config.extract.batch_tokens) for k in batch]
            write_hidden_shard(store, run, shard, spec, source, traces,
                               assemble_shard(states, order, config.extract.storage), stage=HELD_OUT_STAGE)
        finalize_hidden_states(store, run, len(shards), stage=HELD_OUT_STAGE)
        self.stats["validation_s"] = round(time.perf_counter() - started, 3)
        self.say(f"validation states captured: {len(plan.val)} traces in {len(shards)} shard(s)")
        self._set(state=FEEDING, validation="ready")

    def _feed(self, client, plan: OnlinePlan) -> None:
        """Training sequences in ordinal order from where the trainer asks, each once its tokens fit the buffer."""
        config = self.config
        online, in_flight = config.train.online, config.extract.requests_in_flight
        pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="draftline-online-feed")
        pending: dict[Future, int] = {}
        started = time.perf_counter()
        waited = 0.0
        last_want: tuple | None = None
        # After a restart of the server: from where the trainer is (files already there are skipped).
        trainer = read_json(self.folder / TRAINER) or {}
        if self._generation is not None and trainer.get("generation") == self._generation:
            self._next = int(trainer.get("at", self._next))
        try:
            swept = reported = time.monotonic()
            while not self._stop.is_set():
                if time.monotonic() - reported > REPORT_EVERY_S:
                    self._report(plan, waited)
                    reported = time.monotonic()
                trainer = read_json(self.folder / TRAINER) or {}
                if trainer.get("state") in (FINISHED, FAILED):
                    self.trainer_state = trainer["state"]
                    return
                if time.monotonic() - swept > SWEEP_EVERY_S and trainer.get("generation") == self._generation:
                    # Every process has read what lies below the trainer's position: what is left there (sent
                    # again after a restart, or read from the epoch cache instead) would only fill the buffer.
                    sweep(self.folder, self._generation, int(trainer.get("at", 0)))
                    swept = time.monotonic()
                want = self._read_want(last_want)
                if want is None:
                    time.sleep(0.01)
                    continue
                last_want = want[0]
                want = want[1]
                if want.get("plan") != plan.fingerprint:
                    raise ConfigError("the trainer plans other traces than the engine side (another config or traces "
                                      "for the same run and store); start both from the same config")
                if want["generation"] != self._generation:
                    self._generation, self._next = int(want["generation"]), int(want["start"])
                    self._keeps = EpochCache(plan, int(want.get("cache_tokens", 0)))
                    sweep(self.folder, self._generation, 0)
                for f in [f for f in pending if f.done()]:
                    del pending[f]
                    f.result()  # a failed request fails the feed (and restarts the server)
                if want.get("end") is not None and self._next >= int(want["end"]):
                    time.sleep(0.02)  # everything the trainer will read is captured
                    continue
                trace = plan.trace_of(self._next)
                tokens = plan.tokens(trace)
                key = request_key(self._generation, self._next, tokens)
                if not self._keeps.needs_engine(self._next) or (self.folder / f"{key}.safetensors").exists():
                    self._next += 1  # kept by the trainer since an earlier epoch, or already here
                    continue
                used = occupancy(self.folder, self._generation) + sum(pending.values())
                if len(pending) >= in_flight or (used and used + tokens > online.buffer_tokens):
                    t0 = time.perf_counter()
                    if pending:
                        wait(list(pending), timeout=0.02, return_when=FIRST_COMPLETED)
                    else:
                        time.sleep(0.005)
                    if used and used + tokens > online.buffer_tokens:
                        waited += time.perf_counter() - t0
                    continue
                pending[pool.submit(client.request, key, plan.trace_tokens(trace))] = tokens
                self._next += 1
                self.stats["sequences_sent"] += 1
                self.stats["tokens_sent"] += tokens
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            self.stats["backpressure_s"] = round(self.stats["backpressure_s"] + waited, 3)
            self.stats["feed_s"] = round(self.stats.get("feed_s", 0.0) + time.perf_counter() - started, 3)

    def _report(self, plan: OnlinePlan, waited: float) -> None:
        """What the engine side captured so far, as a progress step towards the trainer's last sequence."""
        end = (self._want or {}).get("end")
        start = int((self._want or {}).get("start") or 0)
        done, total = self._next - start, (int(end) - start if end is not None else 0)
        log.info("engine: captured %d sequences (%d tokens), %.0f s waiting for the trainer to make room",
                 self.stats["sequences_sent"], self.stats["tokens_sent"], self.stats["backpressure_s"] + waited,
                 extra=progress_step("capture", min(done, total), total) if total > 0 else None)

    def _read_want(self, last: tuple | None) -> tuple[tuple, dict] | None:
        path = self.folder / WANT
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == last and self._want is not None:
            return stamp, self._want
        self._want = read_json(path)
        return None if self._want is None else (stamp, self._want)
