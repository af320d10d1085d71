"""The hand-off folder between the capturing engine and the trainer: one file per captured request, named by
generation, ordinal and tokens; the trainer's wish (where to start, what it already holds); each side's status; and
the occupancy the engine keeps under train.online.buffer_tokens.

The vLLM connector runs in the engine's own processes, so the hand-off crosses processes through files: the
connector writes `<key>.safetensors` (renamed into place when complete), the trainer maps it and deletes it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

WANT = "want.json"  # the trainer's: {"generation", "start", "held", "plan"}
ENGINE = "engine.json"  # the engine side's status: {"state", "plan", "error", "time"}
TRAINER = "trainer.json"  # the trainer's status: {"state", "at", "error", "time"}
STATUS_FILES = (WANT, ENGINE, TRAINER)

# Engine states: starting → validation → feeding, then stopped or failed. Trainer states: training → finished/failed.
FEEDING, FAILED, STOPPED = "feeding", "failed", "stopped"
FINISHED = "finished"

_FILE = re.compile(r"^g(\d{4})-o(\d{12})-t(\d{7})\.safetensors(\.tmp-\d+|\.error)?$")


def request_key(generation: int, ordinal: int, tokens: int) -> str:
    """The connector's key (and file name, less .safetensors) of one training sequence."""
    return f"g{generation % 10000:04d}-o{ordinal:012d}-t{tokens:07d}"


def request_file(name: str) -> re.Match | None:
    """The parts of a request file's name (generation, ordinal, tokens, suffix), or None for any other file."""
    return _FILE.match(name)


def spool_folder(root: str | None, store_uri: str, run: str) -> Path:
    """The run's hand-off folder: under `root`, else /dev/shm when writable, else the temp dir; one per store and run,
    so that the engine side and the trainer find it from the config alone."""
    if root:
        base = Path(root)
    else:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    tag = hashlib.sha256(f"{store_uri}\n{run}".encode()).hexdigest()[:10]
    return base / f"draftline-online-{re.sub(r'[^A-Za-z0-9_.-]', '_', run)[:64]}-{tag}"


def write_json(path: Path, obj: dict) -> None:
    """Atomically: a reader sees the old content or the new, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def reset(folder: Path) -> None:
    """Empty the folder of an earlier attempt's statuses and files, before either side starts."""
    folder.mkdir(parents=True, exist_ok=True)
    for entry in os.scandir(folder):
        if entry.name in STATUS_FILES or _FILE.match(entry.name):
            Path(entry.path).unlink(missing_ok=True)


@dataclass(frozen=True)
class Spooled:
    """One file of the folder: its generation, ordinal, tokens, and whether it is complete."""

    name: str
    generation: int
    ordinal: int
    tokens: int
    complete: bool


def listing(folder: Path) -> list[Spooled]:
    out = []
    for entry in os.scandir(folder):
        m = _FILE.match(entry.name)
        if m:
            out.append(Spooled(entry.name, int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4) is None))
    return out


def occupancy(folder: Path, generation: int) -> int:
    """Tokens of this generation's files in the folder, complete or being written."""
    return sum(f.tokens for f in listing(folder) if f.generation == generation % 10000)


def sweep(folder: Path, generation: int, below: int) -> int:
    """Delete the files no reader will take: other generations', and this one's below ordinal `below`; returns how
    many."""
    gone = 0
    for f in listing(folder):
        if f.generation != generation % 10000 or (f.ordinal < below and f.complete):
            Path(folder, f.name).unlink(missing_ok=True)
            gone += 1
    return gone


class Status:
    """One side's status file, rewritten at most every `every_s` seconds unless the state changes."""

    def __init__(self, path: Path, every_s: float = 1.0):
        self.path, self.every_s = path, every_s
        self._last: tuple[str, float] | None = None

    def set(self, state: str, force: bool = False, **fields) -> None:
        now = time.time()
        if not force and self._last and self._last[0] == state and now - self._last[1] < self.every_s:
            return
        write_json(self.path, {"state": state, "time": now, "pid": os.getpid(), **fields})
        self._last = (state, now)

    def read(self) -> dict | None:
        return read_json(self.path)
