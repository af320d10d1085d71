"""Online training's hand-off through the store (train.online.hand_off: store) on real S3 (SeaweedFS): two relays
with two local folders carry the protocol's files both ways, the engine side's buffer stays full until the trainer
has consumed a file, a silent engine is still detected by the trainer, and nothing is left in the store at the end."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from draftline.errors import EngineError
from draftline.online.relay import ENGINE_SIDE, TRAINER_SIDE, Relay, online_prefix
from draftline.online.source import EngineWatch
from draftline.online.spool import (ENGINE, FINISHED, STOPPED, TRAINER, WANT, Status, occupancy, read_json,
                                    request_key, write_json)
from draftline.store import open_store

RUN = "relay"


def wait_until(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def write_request(folder: Path, ordinal: int, tokens: int) -> str:
    """A complete request file as the connector leaves it (written under a temp name, renamed into place)."""
    name = f"{request_key(0, ordinal, tokens)}.safetensors"
    tmp = folder / f"{name}.tmp-1"
    tmp.write_bytes(bytes([ordinal]) * (64 + ordinal))
    tmp.rename(folder / name)
    return name


def test_two_relays_carry_the_hand_off_through_s3_keep_the_buffer_full_until_trained_and_leave_nothing(
        s3_uri, tmp_path):
    store = open_store(s3_uri)
    engine_dir, trainer_dir = tmp_path / "engine-machine", tmp_path / "trainer-machine"
    engine = Relay(store, RUN, engine_dir, ENGINE_SIDE, every_s=0.05).start()
    trainer = Relay(store, RUN, trainer_dir, TRAINER_SIDE, every_s=0.05).start()
    try:
        # The trainer's wish and status reach the engine side; the engine's status reaches the trainer.
        write_json(trainer_dir / WANT, {"generation": 0, "plan": "p", "start": 0, "cache_tokens": 0, "end": None})
        Status(trainer_dir / TRAINER).set("training", at=0, generation=0)
        engine_status = Status(engine_dir / ENGINE, every_s=0.0)
        engine_status.set("feeding", plan="p")
        wait_until(lambda: read_json(engine_dir / WANT) == read_json(trainer_dir / WANT))
        wait_until(lambda: (read_json(engine_dir / TRAINER) or {}).get("at") == 0)
        wait_until(lambda: (read_json(trainer_dir / ENGINE) or {}).get("state") == "feeding")

        # Complete request files cross with their bytes; one being written does not.
        names = [write_request(engine_dir, o, 10 + o) for o in range(3)]
        (engine_dir / f"{request_key(0, 3, 13)}.safetensors.tmp-9").write_bytes(b"partial")
        wait_until(lambda: all((trainer_dir / n).exists() for n in names))
        assert [(trainer_dir / n).read_bytes() for n in names] == [(engine_dir / n).read_bytes() for n in names]
        assert not any(p.name.startswith(request_key(0, 3, 13)) for p in trainer_dir.iterdir())

        # Until the trainer consumed a file, it fills the engine side's buffer; once it has, it frees its tokens.
        time.sleep(0.3)
        assert occupancy(engine_dir, 0) == 10 + 11 + 12 + 13
        (trainer_dir / names[0]).unlink()
        wait_until(lambda: not (engine_dir / names[0]).exists())
        assert occupancy(engine_dir, 0) == 11 + 12 + 13
        assert not store.exists(f"{online_prefix(RUN)}/requests/{names[0]}")
        assert (trainer_dir / names[1]).exists() and (engine_dir / names[1]).exists()

        # The heartbeat keeps its meaning: an engine that goes silent is named by the trainer's watch.
        watch = EngineWatch(trainer_dir, wait_s=1.0)
        engine_status.set("feeding", plan="p")
        time.sleep(0.3)
        watch.check("training sequence 1")
        with pytest.raises(EngineError, match="gave no sign of life"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                watch.check("training sequence 1")
                time.sleep(0.05)

        # The trainer finishes: the engine side hears it, stops, and the store's hand-off is gone.
        Status(trainer_dir / TRAINER).set(FINISHED, force=True, at=3)
        trainer.stop()
        wait_until(lambda: (read_json(engine_dir / TRAINER) or {}).get("state") == FINISHED)
        engine_status.set(STOPPED)
    finally:
        trainer.stop()
        engine.stop()
    assert store.list(online_prefix(RUN)) == []
    assert engine.stats["uploaded"] == 3 and trainer.stats["downloaded"] == 3
