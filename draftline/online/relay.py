"""Mirrors one side's hand-off folder through the run's store (train.online.hand_off: store), so that the capturing
engine and the trainer of online training can run on two machines, each with its own local folder.

Under `<run>/online/` the store holds each complete request file (`requests/<name>`) and the statuses. The engine
side's relay uploads its request files and engine.json, takes want.json and trainer.json down, and deletes a local
request file once its object is gone (the trainer consumed it), so the engine's occupancy counts a file until it is
trained on. The trainer side's relay downloads request files (atomically), uploads want.json and trainer.json, takes
engine.json down, and deletes an object once the trainer deleted its local copy. A status taken down is stamped with
the time it arrived, so that the heartbeat keeps its meaning across machines whose clocks differ.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from draftline.errors import ConfigError
from draftline.online.spool import (ENGINE, FAILED, FINISHED, STOPPED, TRAINER, WANT, listing, request_file,
                                    write_json)

ENGINE_SIDE, TRAINER_SIDE = "engine", "trainer"
SYNC_EVERY_S = 0.1
ERROR_LOG_EVERY_S = 30.0
# A side whose status says it has ended reads nothing more from the store.
ENDED = {ENGINE_SIDE: (FAILED, STOPPED), TRAINER_SIDE: (FINISHED, FAILED)}
log = logging.getLogger("draftline.online.relay")


def online_prefix(run: str) -> str:
    """Where the store hand-off of a run lives; nothing of it outlasts the training."""
    return f"{run}/online"


def clear(store, run: str) -> None:
    """Remove an earlier attempt's requests and statuses from the store, before either side starts."""
    store.delete_tree(online_prefix(run))


def upload_status(store, run: str, folder: Path, name: str) -> None:
    """Upload one status file now (the flow's word that the trainer ended, after its relay stopped)."""
    if (folder / name).exists():
        store.put_file(f"{online_prefix(run)}/{name}", folder / name)


class Relay:
    """One side's mirror of its folder through the store: a thread syncing every SYNC_EVERY_S until stop()."""

    def __init__(self, store, run: str, folder: Path, side: str, every_s: float = SYNC_EVERY_S):
        if side not in (ENGINE_SIDE, TRAINER_SIDE):
            raise ValueError(f"a relay is the engine side's or the trainer's, not {side!r}")
        self.store, self.run, self.folder, self.side, self.every_s = store, run, Path(folder), side, every_s
        self.prefix = online_prefix(run)
        self.requests = f"{self.prefix}/requests"
        self.sends = (ENGINE,) if side == ENGINE_SIDE else (WANT, TRAINER)
        self.receives = (WANT, TRAINER) if side == ENGINE_SIDE else (ENGINE,)
        self.other = TRAINER_SIDE if side == ENGINE_SIDE else ENGINE_SIDE
        self.stats = {"uploaded": 0, "downloaded": 0, "bytes": 0, "errors": 0}
        self._sent: dict[str, tuple] = {}
        self._received: dict[str, bytes] = {}
        self._moved: set[str] = set()  # request files this relay carried (uploaded, or downloaded)
        self._consumed: set[str] = set()  # downloaded, then deleted by the trainer: never downloaded again
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_error_log = 0.0

    # ------------------------------------------------------------------ lifetime

    def start(self) -> "Relay":
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.side == ENGINE_SIDE:
            # A new engine side has uploaded nothing yet: what lies there is an earlier attempt's, never read again.
            for key in self.store.list(self.requests):
                self.store.delete(key)
        elif not (self.folder / WANT).exists():
            # The trainer numbers its generations from the last want.json; this machine's folder may be new.
            self._take_down(WANT)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"draftline-relay-{self.side}")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Sync once more (this side's last status), delete the states left in the store, and the whole prefix when
        the other side has ended too."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.sync()
            for key in self.store.list(self.requests):
                self.store.delete(key)
            name = ENGINE if self.side == TRAINER_SIDE else TRAINER
            other = self._read(name)
            # The other side has ended, or has ended and cleaned up after itself (its status was here, and is gone):
            # nobody reads this side's statuses any more. A side never heard from may still start, and needs them.
            if (other is None and name in self._received) or (other or {}).get("state") in ENDED[self.other]:
                self.store.delete_tree(self.prefix)
        except Exception as exc:  # the run's own outcome matters more; the next start clears the prefix
            log.warning("online relay (%s side): could not clean %s: %s", self.side, self.store.uri(self.prefix), exc)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.sync()
            except Exception as exc:  # a store hiccup: try again; a lasting failure shows as a silent side
                self.stats["errors"] += 1
                if time.monotonic() - self._last_error_log > ERROR_LOG_EVERY_S:
                    self._last_error_log = time.monotonic()
                    log.warning("online relay (%s side) could not reach %s: %s", self.side,
                                self.store.uri(self.prefix), exc)

    # ------------------------------------------------------------------ one pass

    def sync(self) -> None:
        listed = {key.rsplit("/", 1)[1] for key in self.store.list(self.requests)}
        if self.side == ENGINE_SIDE:
            self._sync_engine(listed)
        else:
            self._sync_trainer(listed)
        for name in self.sends:
            self._send(name)
        for name in self.receives:
            self._take_down(name)

    def _sync_engine(self, listed: set[str]) -> None:
        for name in [n for n in self._moved if n not in listed]:
            # Uploaded before this listing and gone from the store: trained on, so it no longer fills the buffer.
            Path(self.folder, name).unlink(missing_ok=True)
            self._moved.discard(name)
        present = set()
        for f in listing(self.folder):
            present.add(f.name)
            if f.name in self._moved or not (f.complete or f.name.endswith(".error")):
                continue
            try:
                self.stats["bytes"] += os.path.getsize(self.folder / f.name)
                self.store.put_file(f"{self.requests}/{f.name}", self.folder / f.name)
            except (FileNotFoundError, ConfigError):
                continue  # swept by the engine meanwhile
            self._moved.add(f.name)
            self.stats["uploaded"] += 1
        for name in self._moved - present:
            # Swept by the engine (another generation's, or below the trainer): the trainer will not read it.
            self.store.delete(f"{self.requests}/{name}")
            self._moved.discard(name)

    def _sync_trainer(self, listed: set[str]) -> None:
        for name in [n for n in self._moved if not (self.folder / n).exists()]:
            # The trainer took it (or swept it): its object goes, and the engine side's copy with it.
            self.store.delete(f"{self.requests}/{name}")
            self._moved.discard(name)
            self._consumed.add(name)
        self._consumed &= listed
        for name in sorted(listed - self._moved - self._consumed):
            if request_file(name) is None:
                continue
            # The store writes a temp name and renames it: the trainer never maps part of a file.
            entry = self.store.get_file(f"{self.requests}/{name}", self.folder / name)
            self._moved.add(name)
            self.stats["downloaded"] += 1
            self.stats["bytes"] += entry.size

    def _send(self, name: str) -> None:
        path = self.folder / name
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if self._sent.get(name) != stamp:
            self.store.put_file(f"{self.prefix}/{name}", path)
            self._sent[name] = stamp

    def _read(self, name: str) -> dict | None:
        found = self.store.read_object(f"{self.prefix}/{name}")
        return None if found is None else json.loads(found[0])

    def _take_down(self, name: str) -> None:
        found = self.store.read_object(f"{self.prefix}/{name}")
        if found is None or found[0] == self._received.get(name):
            return
        status = json.loads(found[0])
        if "time" in status:
            status["time"] = time.time()  # a new version arrived now: alive by this machine's clock
        write_json(self.folder / name, status)
        self._received[name] = found[0]


@contextmanager
def relayed(config, store, folder: Path, side: str) -> Iterator[Relay | None]:
    """One side of online training with its relay running when train.online.hand_off is store (else nothing)."""
    if config.train.online.hand_off != "store":
        yield None
        return
    relay = Relay(store, config.run, folder, side).start()
    try:
        yield relay
    finally:
        relay.stop()
