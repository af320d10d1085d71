"""One live owner per run name: a lease object in the store, written with a conditional put and renewed while its run lives.

A pipeline run takes the lease `<run>/lease.json` before its first stage writes anything under the run's folder:

    with RunLease(store, "demo", owner=flow_run_id, label=f"flow run {flow_run_id}").held() as lease:
        ...                      # the stages; lease.check() between them
                                 # leaving releases the lease

Taking it is a conditional write (S3's If-None-Match: *, a hard link on a local folder), so of two runs that start at
once exactly one gets it; the other is refused at once with RunNameTaken naming the holder. The holder renews the
lease every `ttl_s / 4` seconds on a thread of its own. A lease that was not renewed for `ttl_s` seconds belongs to a
run that died: anyone may take it over, again conditionally (If-Match on the version they read). The same owner (a
retry of the same flow run) takes its own lease over at once, so a crashed run resumes as before. Clocks: a lease's
age is the reader's clock minus the holder's; hosts must agree within a small part of `ttl_s` (NTP does).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Callable, Iterator

from draftline.errors import DraftlineError, StoreError
from draftline.layout import run_lease_key
from draftline.store import Store

# A lease not renewed for this long belongs to a run that died; it is renewed four times within it.
LEASE_TTL_S = 120.0
# Takeover attempts when other runs keep changing the lease between our read and our write.
_ATTEMPTS = 5


class RunNameTaken(DraftlineError):
    """Another live run holds the run name; this run was refused before it wrote anything."""

    transient = False


class LeaseLost(DraftlineError):
    """This run's lease was taken over (it was not renewed in time); another run may now write the run's folder."""

    transient = False


class RunLease:
    """The lease on one run name in one store, held by `owner` (e.g. a flow run id; the same owner may take it back)."""

    def __init__(self, store: Store, run: str, owner: str, *, label: str | None = None, stop_hint: str = "",
                 ttl_s: float = LEASE_TTL_S, clock: Callable[[], float] = time.time):
        self.store, self.run, self.owner = store, run, str(owner)
        self.label = label or f"owner {owner}"
        self.stop_hint = stop_hint
        self.ttl_s = float(ttl_s)
        self.clock = clock
        self.key = run_lease_key(run)
        self.token = uuid.uuid4().hex  # this holding, told apart from an earlier one of the same owner
        self.acquired_at = ""
        self.took_over: dict | None = None  # the lease this one replaced (a dead run's, or our own earlier one)
        self.lost: LeaseLost | None = None
        self._version: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # -- the record in the store

    def _record(self) -> bytes:
        now = self.clock()
        stamp = datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds")
        self.acquired_at = self.acquired_at or stamp
        return (json.dumps({
            "run": self.run, "owner": self.owner, "label": self.label, "stop_hint": self.stop_hint,
            "host": socket.gethostname(), "pid": os.getpid(), "token": self.token,
            "acquired_at": self.acquired_at, "renewed_at": stamp, "renewed_unix": now, "ttl_s": self.ttl_s,
        }, indent=1) + "\n").encode()

    @staticmethod
    def _parse(data: bytes) -> dict:
        try:
            record = json.loads(data)
            return record if isinstance(record, dict) else {}
        except ValueError:
            return {}  # unreadable: treated as a lease of no one, expired

    def _age(self, record: dict) -> float:
        try:
            return self.clock() - float(record["renewed_unix"])
        except (KeyError, TypeError, ValueError):
            return float("inf")

    def _expired(self, record: dict) -> bool:
        try:
            ttl = float(record.get("ttl_s", self.ttl_s))
        except (TypeError, ValueError):
            ttl = self.ttl_s
        return self._age(record) > ttl

    # -- taking, renewing, releasing

    def acquire(self) -> "RunLease":
        """Take the lease, or raise RunNameTaken naming the live run that holds it."""
        for _ in range(_ATTEMPTS):
            body = self._record()
            version = self.store.create_object(self.key, body)
            if version is not None:
                return self._holding(version)
            current = self.store.read_object(self.key)
            if current is None:
                continue  # released between our write and our read: try again
            data, version = current
            record = self._parse(data)
            if record.get("owner") == self.owner or self._expired(record):
                new = self.store.replace_object(self.key, body, version)
                if new is not None:
                    self.took_over = record
                    return self._holding(new)
                continue  # another run took it over first: look again
            raise RunNameTaken(self._taken_message(record))
        raise StoreError(f"the lease {self.store.uri(self.key)} changed {_ATTEMPTS} times while this run tried to take "
                         "it: other runs of this name are starting at the same time; start this one again later",
                         transient=True)

    def _holding(self, version: str) -> "RunLease":
        # Read back: an endpoint that ignores conditional writes could have let a racing writer's put land last.
        current = self.store.read_object(self.key)
        if current is None or self._parse(current[0]).get("token") != self.token:
            holder = self._parse(current[0]) if current else {}
            raise RunNameTaken(self._taken_message(holder))
        self._version = current[1]
        return self

    def _taken_message(self, record: dict) -> str:
        label = record.get("label") or f"owner {record.get('owner', 'unknown')}"
        age = self._age(record)
        try:
            ttl = float(record.get("ttl_s", self.ttl_s))
        except (TypeError, ValueError):
            ttl = self.ttl_s
        left = max(0.0, ttl - age)
        stop = f", stop it (`{record['stop_hint']}`)" if record.get("stop_hint") else ", stop it"
        return (f"the run name {self.run!r} is taken: {label} on {record.get('host', 'an unknown host')} is writing its "
                f"stages in {self.store.uri(self.run)} (lease renewed {age:.0f} s ago); wait for it to end{stop}, or "
                f"give this run another name (`run`); a run that died gives the name up {left:.0f} s from now, when "
                f"its lease ({ttl:.0f} s) lapses")

    def renew(self) -> None:
        """Write a fresh renewal time, only while the lease is still ours; raises LeaseLost otherwise."""
        if self._version is None:
            raise LeaseLost(f"the lease on run {self.run!r} is not held; acquire it first")
        new = self.store.replace_object(self.key, self._record(), self._version)
        if new is None:
            current = self.store.read_object(self.key)
            holder = self._parse(current[0]) if current else {}
            who = holder.get("label") or "no run"
            raise LeaseLost(f"the lease on run {self.run!r} ({self.store.uri(self.key)}) was taken over by {who} "
                            f"after this run did not renew it for {self.ttl_s:.0f} s; this run no longer owns the "
                            "run's folder and stops")
        self._version = new

    def release(self) -> bool:
        """Give the name up (only while the lease is still ours); True when this call removed it."""
        version, self._version = self._version, None
        if version is None:
            return False
        return self.store.delete_object(self.key, version)

    def check(self) -> None:
        """Raise LeaseLost if the renewer found the lease taken over; call it between stages."""
        if self.lost is not None:
            raise self.lost

    def _renew_until_stopped(self) -> None:
        every = self.ttl_s / 4
        while not self._stop.wait(every):
            try:
                self.renew()
            except LeaseLost as exc:
                self.lost = exc
                print(f"draftline: {exc}", file=sys.stderr, flush=True)
                return
            except (StoreError, OSError) as exc:  # the store hiccuped: the next renewal may succeed
                print(f"draftline: could not renew the lease on run {self.run!r} ({exc}); trying again in "
                      f"{every:.0f} s", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def held(self) -> Iterator["RunLease"]:
        """Acquire, renew in the background while the block runs, release at its end (whatever the outcome)."""
        self.acquire()
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_until_stopped, name="draftline-lease", daemon=True)
        self._renewer.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._renewer.join()
            if self.lost is None:
                try:
                    self.release()
                except StoreError as exc:  # the lease then lapses on its own; the run's own outcome stands
                    print(f"draftline: could not release the lease on run {self.run!r} ({exc}); it lapses "
                          f"{self.ttl_s:.0f} s after its last renewal", file=sys.stderr, flush=True)
