"""Online training as one call: the engine side in a thread of this process, the trainer here (or its torchrun ranks),
each side's failure named; what `draftline train` and the stages run with train.source engine."""
from __future__ import annotations

import logging
import shutil
import threading
from typing import Callable

from draftline.config import PipelineConfig
from draftline.errors import EngineError
from draftline.online.relay import ENGINE_SIDE, TRAINER_SIDE, clear, relayed, upload_status
from draftline.online.source import hand_off_folder
from draftline.online.spool import FAILED, FINISHED, TRAINER, Status, reset

log = logging.getLogger("draftline.online")
ENGINE_STOP_WAIT_S = 10.0


def prepare(config: PipelineConfig) -> None:
    """Check that both sides fit on this worker's GPUs, and clear the hand-off folders (and with hand_off store, the
    store's hand-off) of an earlier attempt, before either side starts."""
    from draftline.online.placement import check_placement

    placed = check_placement(config)
    if placed:
        log.info("online training: %s", placed)
    for side in (ENGINE_SIDE, TRAINER_SIDE):
        reset(hand_off_folder(config, side))
    if config.train.online.hand_off == "store":
        clear(_store(config), config.run)


def clean_up(config: PipelineConfig) -> None:
    """Remove the hand-off folders (in memory under /dev/shm), and the store's hand-off, once both sides are done."""
    for side in (ENGINE_SIDE, TRAINER_SIDE):
        shutil.rmtree(hand_off_folder(config, side), ignore_errors=True)
    if config.train.online.hand_off == "store":
        clear(_store(config), config.run)


def _store(config: PipelineConfig):
    from draftline.store import open_store

    return open_store(config.store.root)


def trainer_ended(config: PipelineConfig, completed: bool) -> None:
    """Mark the trainer ended so that the engine side stops: failed unless it completed (a trainer that was killed,
    or served from a cache, says nothing itself)."""
    folder = hand_off_folder(config, TRAINER_SIDE)
    folder.mkdir(parents=True, exist_ok=True)
    status = Status(folder / TRAINER)
    if not completed:
        status.set(FAILED, force=True, error=(status.read() or {}).get("error") or "the trainer's task did not complete")
    elif (status.read() or {}).get("state") != FINISHED:
        status.set(FINISHED, force=True)
    else:
        return
    if config.train.online.hand_off == "store":  # the trainer's relay has stopped: the word goes up from here
        upload_status(_store(config), config.run, folder, TRAINER)


def run_engine(config: PipelineConfig, store, say: Callable[[str], None] | None = None, feed=None) -> dict:
    """The engine side until the trainer is done; returns what it captured, and the trainer's final state."""
    from draftline.online.engine import EngineFeed

    feed = feed or EngineFeed(config, store, say=say or log.info)
    with relayed(config, store, feed.folder, ENGINE_SIDE):
        return feed.run()


def run_trainer(config: PipelineConfig, store, on_line: Callable[[str], None] | None = None) -> dict:
    """The trainer side (torchrun ranks with train.processes > 1); its status file tells the engine side it is done,
    or that it failed."""
    folder = hand_off_folder(config, TRAINER_SIDE)
    status = Status(folder / TRAINER)
    with relayed(config, store, folder, TRAINER_SIDE):  # it stops after the last status, and carries it
        try:
            if config.train.processes > 1:
                from draftline.drafter.torchrun import train_with_torchrun

                summary = train_with_torchrun(config, store, on_line)
            else:
                from draftline.drafter.train import train_drafter
                from draftline.online.source import online_training_data

                summary = train_drafter(store, config.run, config.target.path, config.drafter, config.train,
                                        replay_answer_tokens=config.eval.max_new_tokens,
                                        data=online_training_data(config, store))
        except BaseException as exc:
            status.set(FAILED, force=True, error=str(exc).split("\n", 1)[0] or type(exc).__name__)
            raise
        status.set(FINISHED, force=True)
    return summary


def train_online(config: PipelineConfig, store, on_line: Callable[[str], None] | None = None) -> dict:
    """Both sides in this process; the training summary with the engine side's figures under "engine"."""
    from draftline.online.engine import EngineFeed

    prepare(config)
    feed = EngineFeed(config, store, say=log.info)
    outcome: dict = {}

    def engine_side() -> None:
        try:
            outcome["engine"] = run_engine(config, store, feed=feed)
        except BaseException as exc:  # the trainer sees it in the status file and raises, naming the engine side
            outcome["error"] = exc

    thread = threading.Thread(target=engine_side, name="draftline-engine-side", daemon=True)
    thread.start()
    try:
        summary = run_trainer(config, store, on_line)
        # The engine side stops on the trainer's word, which may still be crossing the store.
        thread.join(timeout=ENGINE_STOP_WAIT_S)
    except EngineError:
        feed.stop()
        thread.join()
        if "error" in outcome:  # the engine side's own exception says more than the trainer's report of it
            raise outcome["error"] from None
        raise
    finally:
        feed.stop()
        thread.join()
        clean_up(config)
    return {**summary, "engine": outcome.get("engine")}
