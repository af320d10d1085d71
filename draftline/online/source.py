"""The trainer's side of online training: the engine's captured states, read from the hand-off folder in the plan's
order, as the same batches, validation parts and vocabulary counts that training takes from shards."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import torch

from draftline.config import PipelineConfig
from draftline.drafter.data import Cursor, Sequence, ShardPart
from draftline.drafter.training_data import TrainingData
from draftline.errors import ConfigError, EngineError
from draftline.layout import held_out_prefix
from draftline.online.plan import EpochCache, OnlinePlan, build_plan
from draftline.online.spool import (ENGINE, FAILED, FINISHED, STOPPED, TRAINER, WANT, Status, read_json,
                                    request_key, spool_folder, sweep, write_json)
from draftline.safetensors_io import map_safetensors
from draftline.state_storage import FP8_E4M3, SCALE_SUFFIX, STATE_NAMES, dequantize_rows

SWEEP_EVERY_S = 2.0


def plan_identity(config: PipelineConfig) -> dict:
    """What besides the traces decides the captured states: target, layers, storage and dtype."""
    from draftline.aux_ids import AuxLayerIds
    from draftline.target import num_layers, target_fingerprint

    aux = AuxLayerIds.for_target(config.extract.aux_layer_ids, num_layers(config.target.path)).as_list()
    return {"target": target_fingerprint(config.target.path), "aux": aux, "storage": config.extract.storage,
            "dtype": config.extract.vllm.resolved(config.target.dtype).dtype}


def online_plan(config: PipelineConfig, store, identity: dict | None = None) -> OnlinePlan:
    t = config.train
    return build_plan(store, config.run, t.val_fraction, t.max_seq_len, t.seed, identity or plan_identity(config))


def hand_off_folder(config: PipelineConfig, side: str = "trainer") -> Path:
    """The side's local folder of the hand-off: one for both sides with hand_off local; with store each side its own
    (named by the side, so that both may also run on one machine), which its relay mirrors through the store."""
    folder = spool_folder(config.train.online.spool_dir, config.store.root, config.run)
    return folder if config.train.online.hand_off == "local" else folder.with_name(f"{folder.name}-{side}")


class EngineWatch:
    """The trainer's view of the engine side: raises one EngineError, naming the engine side, when it failed, stopped,
    or gave no sign of life (its status heartbeat) for wait_s seconds."""

    def __init__(self, folder: Path, wait_s: float, reaches: str | None = None):
        """reaches: where the engine side's statuses come from, when not written into `folder` itself (the store)."""
        self.folder, self.wait_s = folder, wait_s
        self.reaches = reaches or f"does it write to {folder}"
        self.since = time.time()
        self._checked = 0.0

    def check(self, waiting_for: str) -> dict | None:
        now = time.time()
        if now - self._checked < 0.25:
            return None
        self._checked = now
        status = read_json(self.folder / ENGINE)
        if status is not None and status.get("state") == FAILED:
            raise EngineError(f"the engine side of online training failed, so the trainer stops: {status.get('error')}",
                              transient=False)
        if status is not None and status.get("state") == STOPPED:
            raise EngineError(f"the engine side of online training stopped while the trainer waited for {waiting_for}",
                              transient=False)
        alive = max(self.since, float(status["time"])) if status else self.since
        if now - alive > self.wait_s:
            raise EngineError(f"the engine side of online training gave no sign of life for {now - alive:.0f} s while "
                              f"the trainer waited for {waiting_for} (train.online.wait_s={self.wait_s:.0f}); is its "
                              f"task running, and {self.reaches}?", transient=False)
        return status


class SpoolReader:
    """Takes each training sequence's file from the folder (waiting while the engine side lives), checks it, deletes
    it, and keeps up to cache_tokens of sequences for the later epochs (EpochCache's rule)."""

    def __init__(self, folder: Path, plan: OnlinePlan, storage: str, watch: EngineWatch, generation: int,
                 cache_tokens: int = 0, main: bool = True, single: bool = True):
        self.folder, self.plan, self.storage, self.watch = folder, plan, storage, watch
        self.generation, self.main, self.single = generation, main, single
        self.cache: dict[int, Sequence] = {}
        self.keeps = EpochCache(plan, cache_tokens)
        self.waited_s = 0.0
        self._swept = time.monotonic()
        self.status = Status(folder / TRAINER, every_s=0.0)  # each step: an engine restart resumes exactly there

    def sequence(self, ordinal: int, trace: int) -> Sequence:
        if not self.keeps.needs_engine(ordinal):
            return self.cache[trace]
        tokens = self.plan.tokens(trace)
        path = self.folder / f"{request_key(self.generation, ordinal, tokens)}.safetensors"
        started, pause = time.monotonic(), 0.0005
        while not path.exists():
            error = Path(f"{path}.error")
            if error.exists():
                raise EngineError(f"the engine side could not write the states of training sequence {ordinal}: "
                                  f"{error.read_text()}", transient=False)
            self.watch.check(f"training sequence {ordinal}")
            time.sleep(pause)
            pause = min(0.02, pause * 2)
        self.waited_s += time.monotonic() - started
        data, meta = map_safetensors(str(path))
        os.remove(path)  # the map keeps the pages while the tensors live
        if data["token_ids"].tolist() != self.plan.trace_tokens(trace):
            raise EngineError(f"the states in {path.name} belong to other tokens than training sequence {ordinal}; "
                              f"another run shares the folder {self.folder}", transient=False)
        if meta.get("storage") != self.storage:
            raise EngineError(f"{path.name} holds states in storage {meta.get('storage')!r}, not {self.storage!r}; "
                              "the engine runs a connector other than this draftline's", transient=False)
        aux, last = (data[n] if self.storage != FP8_E4M3 else dequantize_rows(data[n], data[n + SCALE_SUFFIX])
                     for n in STATE_NAMES)
        seq = Sequence(data["token_ids"], self.plan.trace_mask(trace), aux, last)
        if self.keeps.first.get(trace) == ordinal:
            # Copies in this process's memory: the map would keep the deleted file's pages in /dev/shm, whose size
            # bounds the hand-off (a container's is often small).
            seq = Sequence(seq.input_ids.clone(), seq.loss_mask, seq.aux.clone(), seq.last.clone())
            self.cache[trace] = seq
        return seq

    def progress(self, ordinal: int) -> None:
        """The trainer is at `ordinal`: say so (an engine restart resumes there), and delete files no reader will
        take."""
        if not self.main:
            return
        self.status.set("training", at=ordinal, generation=self.generation, waited_s=round(self.waited_s, 3))
        if self.single and time.monotonic() - self._swept > SWEEP_EVERY_S:
            sweep(self.folder, self.generation, ordinal)
            self._swept = time.monotonic()


class SpooledSequence:
    """A training sequence whose states are read when first used: under several processes each reads only the
    sequences of its own rows (the files of the others are theirs to take)."""

    def __init__(self, reader: SpoolReader, ordinal: int, trace: int):
        self.reader, self.ordinal, self.trace = reader, ordinal, trace
        self._seq: Sequence | None = None

    def __len__(self) -> int:
        return self.reader.plan.tokens(self.trace)

    def _loaded(self) -> Sequence:
        if self._seq is None:
            self._seq = self.reader.sequence(self.ordinal, self.trace)
        return self._seq

    input_ids = property(lambda self: self._loaded().input_ids)
    loss_mask = property(lambda self: self._loaded().loss_mask)
    aux = property(lambda self: self._loaded().aux)
    last = property(lambda self: self._loaded().last)


class OnlineStream:
    """Endless global batches of whole sequences (about tokens_per_batch tokens) in the plan's order, the cursor
    after each batch enough to resume: BatchStream's interface over the engine's states."""

    def __init__(self, reader: SpoolReader | None, tokens_per_batch: int, cursor: Cursor,
                 plan: OnlinePlan | None = None):
        self.reader, self.plan, self.tokens_per_batch = reader, plan or reader.plan, tokens_per_batch
        self.cursor = cursor

    def _advance(self, cursor: Cursor) -> tuple[Cursor, list[tuple[int, int]]]:
        """The (ordinal, trace) pairs of the batch at `cursor`, and the cursor after it."""
        c = Cursor(**cursor.to_dict())
        batch, tokens = [], 0
        while tokens < self.tokens_per_batch:
            if c.seq >= len(self.plan.train):
                c.epoch, c.seq = c.epoch + 1, 0
            trace = self.plan.order(c.epoch)[c.seq]
            n = self.plan.tokens(trace)
            if batch and tokens + n > self.tokens_per_batch:
                break
            batch.append((self.plan.ordinal(c.epoch, c.seq), trace))
            tokens += n
            c.seq += 1
        return c, batch

    def end_after(self, steps: int) -> int:
        """The ordinal after the last sequence `steps` more batches read: the engine captures nothing beyond."""
        c = self.cursor
        for _ in range(steps):
            c, _ = self._advance(c)
        return self.plan.ordinal(c.epoch, c.seq)

    def next_batch(self) -> list[SpooledSequence]:
        self.reader.progress(self.plan.ordinal(self.cursor.epoch, self.cursor.seq))
        self.cursor, batch = self._advance(self.cursor)
        return [SpooledSequence(self.reader, ordinal, trace) for ordinal, trace in batch]

    def close(self) -> None:
        """Training reads no more: the engine side may stop."""
        if self.reader.main:
            self.reader.status.set(FINISHED, force=True, at=self.plan.ordinal(self.cursor.epoch, self.cursor.seq))


def _held_out_parts(config: PipelineConfig, store, plan: OnlinePlan, watch: EngineWatch) -> tuple[list, dict]:
    """The validation's shard parts and manifest entries, once the engine side has captured them (it does so first)."""
    if not plan.val:
        return [], {}
    while True:
        status = watch.check("the validation's hidden states")
        if status and status.get("plan") == plan.fingerprint and status.get("validation") == "ready":
            break
        time.sleep(0.05)
    manifest = store.read_manifest(held_out_prefix(config.run))
    if manifest is None:
        raise EngineError(f"the engine side reported the validation ready but {store.uri(held_out_prefix(config.run))}"
                          " has no manifest", transient=False)
    entries = {e.key: e for e in manifest}
    parts = [ShardPart(e.key, 0, int(e.metadata["sequences"]), int(e.metadata["tokens"])) for e in manifest]
    return parts, entries


def online_training_data(config: PipelineConfig, store) -> TrainingData:
    """What train_drafter reads with train.source engine: the plan's training traces from the engine side's folder,
    the validation from `<run>/hidden-val/` (waiting until the engine side has captured it)."""
    from draftline.drafter.vocab import count_tokens

    if config.train.source != "engine":
        raise ConfigError("online_training_data is for train.source: engine")
    identity = plan_identity(config)
    plan = online_plan(config, store, identity)
    folder = hand_off_folder(config, "trainer")
    folder.mkdir(parents=True, exist_ok=True)
    online = config.train.online
    reaches = None
    if online.hand_off == "store":
        from draftline.online.relay import online_prefix

        reaches = f"does its relay reach {store.uri(online_prefix(config.run))}"
    watch = EngineWatch(folder, online.wait_s, reaches)
    val_parts, entries = _held_out_parts(config, store, plan, watch)
    val_tokens = sum(p.tokens for p in val_parts)

    def token_counts(vocab_size: int) -> torch.Tensor:
        keep = torch.zeros_like(plan.loss_mask)
        for t in plan.train:
            keep[int(plan.offsets[t]):int(plan.offsets[t + 1])] = True
        return count_tokens(plan.input_ids, plan.loss_mask & keep, vocab_size)

    def open_stream(cursor: Cursor, rank: int, world: int, barrier: Callable[[], None],
                    steps: int | None = None) -> OnlineStream:
        # Ranks read disjoint sequences: they keep none for later epochs.
        cache_tokens = online.epoch_cache_tokens if world == 1 else 0
        stream = OnlineStream(None, config.train.tokens_per_batch, cursor, plan)
        if rank == 0:
            # A new generation per trainer start: files the engine captured for an earlier one are never read.
            before = read_json(folder / WANT) or {}
            write_json(folder / WANT, {"generation": int(before.get("generation", -1)) + 1, "plan": plan.fingerprint,
                                       "start": plan.ordinal(cursor.epoch, cursor.seq), "cache_tokens": cache_tokens,
                                       "end": None if steps is None else stream.end_after(steps)})
        barrier()
        generation = int(read_json(folder / WANT)["generation"])
        stream.reader = SpoolReader(folder, plan, config.extract.storage, watch, generation, cache_tokens,
                                    main=rank == 0, single=world == 1)
        return stream

    total = plan.train_tokens + val_tokens
    return TrainingData(
        aux_ids=identity["aux"], val_parts=val_parts, expected=entries,
        identity={"source": "engine", "plan": plan.fingerprint, "val": [str(p) for p in val_parts]},
        record={"train_shards": [f"engine: {len(plan.train)} traces ({plan.train_tokens} tokens) of "
                                 f"{store.uri(f'{config.run}/traces')}"],
                "val_shards": [str(p) for p in val_parts], "val_sequences": len(plan.val),
                "val_tokens": val_tokens, "held_out_share": val_tokens / total if total else None},
        token_counts=token_counts, open_stream=open_stream)

