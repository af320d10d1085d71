"""The artifact store: one interface over a local folder or s3://bucket/prefix, with sha256 manifests and atomic publishing.

Keys are '/'-separated paths relative to the store root, laid out as `<run>/<stage>/...`. Every write is atomic
(a reader sees the old object, the new one, or none, never a partial one). A manifest (`<prefix>/manifest.json`)
lists objects under a prefix with size, sha256 and free-form metadata; it is written only after every object it
names exists, and reads through `get_dir`, `verify` or `expect=` check stored bytes against it.

In manifest.json entry keys are stored relative to the manifest's prefix, so a copied tree stays valid; in
Python (`ManifestEntry.key`) they are full store keys, like every other key of this API.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import queue
import re
import tempfile
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator, Mapping

from draftline.errors import ConfigError, IntegrityError, StoreError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "draftline-manifest/1"
_CHUNK = 8 * 1024 * 1024
# Large local writes start flushing to disk every this many bytes (0: only at the end). Otherwise the page cache
# holds a whole shard until the final fsync, and the disk idles while the writer hashes and copies.
EARLY_WRITEBACK_BYTES = 64 * 1024 * 1024
# Large local writes hash on a second thread while the first copies the same bytes into the file, instead of
# taking turns (on the H200 machine, 8 shard writers: 145k against 140k tokens/s,
# benchmarks/log/2026-12-01-h200-extraction.md).
HASH_ON_THE_SIDE = True
_TMP_MARK = ".draftline-tmp-"
_CACHE_INDEX = ".draftline-cache.json"


class ObjectNotFound(StoreError):
    """The key names no object in the store (not transient: the object has to be written first)."""


# ---------------------------------------------------------------------------------------------- manifests


@dataclass(frozen=True)
class ManifestEntry:
    """One stored object as a manifest records it: full store key, size in bytes, sha256 hex, metadata."""

    key: str
    size: int
    sha256: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def with_key(self, key: str) -> "ManifestEntry":
        return ManifestEntry(key=key, size=self.size, sha256=self.sha256, metadata=dict(self.metadata))


@dataclass
class Manifest:
    """The entries stored under `prefix`, in key order; look entries up by full key or by key relative to prefix."""

    prefix: str
    entries: list[ManifestEntry]
    created: str = ""

    def __post_init__(self):
        self.entries = sorted(self.entries, key=lambda e: e.key)
        self._by_key = {e.key: e for e in self.entries}

    def _full(self, key: str) -> str:
        return key if key in self._by_key else _join(self.prefix, key)

    def get(self, key: str) -> ManifestEntry | None:
        return self._by_key.get(self._full(key))

    def __getitem__(self, key: str) -> ManifestEntry:
        entry = self.get(key)
        if entry is None:
            raise KeyError(key)
        return entry

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def __iter__(self) -> Iterator[ManifestEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def keys(self) -> list[str]:
        return [e.key for e in self.entries]

    @property
    def total_size(self) -> int:
        return sum(e.size for e in self.entries)

    def relative_key(self, key: str) -> str:
        return _relative(self.prefix, key)

    def to_json(self) -> str:
        doc = {
            "format": MANIFEST_FORMAT,
            "created": self.created or _now(),
            "entries": [
                {"key": self.relative_key(e.key), "size": e.size, "sha256": e.sha256, "metadata": e.metadata}
                for e in self.entries
            ],
        }
        return json.dumps(doc, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, prefix: str, text: str | bytes, where: str) -> "Manifest":
        try:
            doc = json.loads(text)
            if doc.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}, expected {MANIFEST_FORMAT!r}")
            entries = [
                ManifestEntry(
                    key=_join(prefix, _check_key(str(e["key"]))),
                    size=int(e["size"]),
                    sha256=str(e["sha256"]),
                    metadata=dict(e.get("metadata") or {}),
                )
                for e in doc["entries"]
            ]
        except (ValueError, KeyError, TypeError, AttributeError, ConfigError) as exc:
            raise IntegrityError(f"The manifest {where} is unreadable ({exc}); rewrite it by re-running the stage that wrote it.") from exc
        return cls(prefix=prefix, entries=entries, created=str(doc.get("created", "")))


# ---------------------------------------------------------------------------------------------- helpers


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


_BAD_KEY = re.compile(r"(^/|//|\\|(^|/)\.\.?(/|$))")


def _check_key(key: str, what: str = "key") -> str:
    if not isinstance(key, str) or not key or _BAD_KEY.search(key) or key.endswith("/") or _TMP_MARK in key:
        raise ConfigError(
            f"The store {what} {key!r} is not a relative '/'-separated path; write it like 'run/stage/file' "
            "(no leading '/', no '.' or '..' parts, no empty parts)."
        )
    return key


def _check_prefix(prefix: str) -> str:
    prefix = prefix.strip("/") if isinstance(prefix, str) else prefix
    if prefix == "":
        return ""
    return _check_key(prefix, "prefix")


def _join(prefix: str, rel: str) -> str:
    return f"{prefix}/{rel}" if prefix else rel


def _relative(prefix: str, key: str) -> str:
    if not prefix:
        return key
    if not key.startswith(prefix + "/"):
        raise ConfigError(f"The key {key!r} is not under the prefix {prefix!r}; give a key inside that folder.")
    return key[len(prefix) + 1:]


def _manifest_key(prefix: str) -> str:
    return _join(prefix, MANIFEST_NAME)


def _is_manifest(key: str) -> bool:
    return key == MANIFEST_NAME or key.endswith("/" + MANIFEST_NAME)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a local file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class _HashingReader(io.RawIOBase):
    """Reads a stream once, front to back, counting bytes and hashing them (deliberately not seekable)."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self.size = 0
        self._digest = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self._stream.read(n)
        if data:
            self.size += len(data)
            self._digest.update(data)
        return data

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()


def _check_expected(key: str, size: int, sha256: str, expect: ManifestEntry | None, where: str) -> None:
    if expect is None:
        return
    if size != expect.size or sha256 != expect.sha256:
        raise IntegrityError(
            f"The stored object {key!r} at {where} does not match its manifest "
            f"(size {size} vs {expect.size}, sha256 {sha256[:12]} vs {expect.sha256[:12]}); "
            "it was changed or damaged after publishing: re-run the stage that wrote it."
        )


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_local_write(dest: Path, stream: BinaryIO) -> tuple[int, str]:
    """Copy a stream to dest through a temp file in the same folder (fsync, then rename); returns (size, sha256)."""
    reader = _HashingReader(stream)

    def copy(out) -> tuple[int, str]:
        while chunk := reader.read(_CHUNK):
            out.write(chunk)
        return reader.size, reader.sha256

    return _atomic_local(dest, copy)


class BackgroundFlush:
    """fdatasync of an open file in a background thread, one at a time: the disk drains what was written so far
    while the writer hashes and copies the next bytes (the final fsync then waits for the rest only)."""

    def __init__(self, fd: int):
        self.fd, self.thread, self.error = fd, None, None

    def start(self) -> bool:
        """Begin a flush unless one is still running (then the next call covers these bytes too)."""
        if self.thread is not None and self.thread.is_alive():
            return False
        self.thread = threading.Thread(target=self._flush, name="draftline-flush", daemon=True)
        self.thread.start()
        return True

    def _flush(self) -> None:
        try:
            getattr(os, "fdatasync", os.fsync)(self.fd)
        except OSError as exc:
            self.error = exc

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error


class SideHash:
    """sha256 of buffers fed in order, computed on a thread of its own (hashlib drops the GIL on large buffers), so
    the caller can write the same memory meanwhile. The buffers must stay unchanged until hexdigest() returns."""

    _END = object()

    def __init__(self):
        self.digest, self.error = hashlib.sha256(), None
        self.pieces: queue.Queue = queue.Queue(maxsize=64)  # views, not copies; bounded for generated chunks
        self.thread = threading.Thread(target=self._run, name="draftline-hash", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (piece := self.pieces.get()) is not self._END:
            if self.error is None:
                try:
                    self.digest.update(piece)
                except BaseException as exc:  # reported by hexdigest; keep draining so feed() never blocks forever
                    self.error = exc

    def feed(self, piece) -> None:
        self.pieces.put(piece)

    def close(self) -> None:
        if self.thread.is_alive():
            self.pieces.put(self._END)
            self.thread.join()

    def hexdigest(self) -> str:
        self.close()
        if self.error is not None:
            raise self.error
        return self.digest.hexdigest()


class InlineHash:
    """SideHash's interface on the caller's own thread."""

    def __init__(self):
        self.digest = hashlib.sha256()

    def feed(self, piece) -> None:
        self.digest.update(piece)

    def close(self) -> None:
        pass

    def hexdigest(self) -> str:
        return self.digest.hexdigest()


def _atomic_local_write_chunks(dest: Path, chunks: Iterable) -> tuple[int, str]:
    """Write buffers (bytes, memoryviews) to dest as _atomic_local_write does, straight from their memory."""

    def copy(out) -> tuple[int, str]:
        size, flushed = 0, 0
        writeback = BackgroundFlush(out.fileno())
        digest = SideHash() if HASH_ON_THE_SIDE else InlineHash()
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                for start in range(0, len(view), _CHUNK):
                    piece = view[start:start + _CHUNK]
                    digest.feed(piece)
                    size += len(piece)
                    while piece:
                        piece = piece[out.write(piece):]  # unbuffered: the kernel copies from the caller's memory
                    if EARLY_WRITEBACK_BYTES and size - flushed >= EARLY_WRITEBACK_BYTES and writeback.start():
                        flushed = size
            return size, digest.hexdigest()
        finally:
            digest.close()
            writeback.wait()  # before the file closes: the flush holds its descriptor

    return _atomic_local(dest, copy, buffering=0)


def _atomic_local(dest: Path, copy, buffering: int = -1) -> tuple[int, str]:
    """Run copy(file) on a temp file next to dest, fsync it, rename it to dest; returns copy's (size, sha256)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}{_TMP_MARK}{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "wb", buffering=buffering) as out:
            size, digest = copy(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(dest.parent)
    return size, digest


class ChunkReader(io.RawIOBase):
    """Buffers (bytes, memoryviews) as one read-once stream, without joining them first."""

    def __init__(self, chunks: Iterable):
        self._parts = [memoryview(c).cast("B") for c in chunks]
        self._parts.reverse()  # popped from the end

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self._parts and not len(self._parts[-1]):
            self._parts.pop()
        if not self._parts:
            return 0
        head = self._parts[-1]
        n = min(len(buf), len(head))
        buf[:n] = head[:n]
        self._parts[-1] = head[n:]
        return n


def default_cache_dir() -> Path:
    """Where S3 directories are materialised: $DRAFTLINE_CACHE_DIR, else ~/.cache/draftline."""
    env = os.environ.get("DRAFTLINE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "draftline"


# ---------------------------------------------------------------------------------------------- the interface


class Store(ABC):
    """An artifact store; subclasses provide the object primitives, this class the manifests and directories."""

    # -- primitives each backend implements

    @abstractmethod
    def uri(self, key: str = "") -> str:
        """The URI of a key (or of the store root with no key): a local path or s3://bucket/prefix/key."""

    @abstractmethod
    def put_stream(self, key: str, stream: BinaryIO, metadata: Mapping[str, Any] | None = None) -> ManifestEntry:
        """Store everything read from `stream` under `key`, atomically; returns its manifest entry."""

    @abstractmethod
    def get_file(self, key: str, local_path: str | os.PathLike, expect: ManifestEntry | None = None) -> ManifestEntry:
        """Download `key` to `local_path` (atomically); with `expect`, raise IntegrityError unless size and sha256 match."""

    @abstractmethod
    def open(self, key: str) -> BinaryIO:
        """A streaming binary reader over the object (close it when done)."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored under `key`."""

    @abstractmethod
    def size(self, key: str) -> int:
        """The stored object's size in bytes."""

    @abstractmethod
    def _list_sizes(self, prefix: str) -> dict[str, int]:
        """Every key under the folder `prefix` (all keys for ''), with its size."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; a missing object is not an error."""

    @abstractmethod
    def clean_partial(self, prefix: str = "", older_than_s: float = 24 * 3600) -> int:
        """Remove what crashed writers left under `prefix` (never visible as objects); returns how many were removed."""

    @abstractmethod
    def get_dir(self, prefix: str, local_dir: str | os.PathLike | None = None) -> Path:
        """Materialise the directory stored under `prefix` (by its manifest) locally, verified; returns the folder."""

    # -- derived operations

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys under the folder `prefix` (every key for '')."""
        return sorted(self._list_sizes(_check_prefix(prefix)))

    def put_chunks(self, key: str, chunks: Iterable, metadata: Mapping[str, Any] | None = None) -> ManifestEntry:
        """Store the concatenation of `chunks` (bytes, memoryviews) under `key` atomically, without joining them."""
        return self.put_stream(key, ChunkReader(chunks), metadata)

    def put_bytes(self, key: str, data: bytes, metadata: Mapping[str, Any] | None = None) -> ManifestEntry:
        """Store bytes under `key` atomically; `metadata` is carried in the returned entry (for the manifest)."""
        return self.put_stream(key, io.BytesIO(data), metadata)

    def put_file(self, key: str, local_path: str | os.PathLike, metadata: Mapping[str, Any] | None = None) -> ManifestEntry:
        """Upload a local file under `key` atomically, streamed (multipart on S3)."""
        path = Path(local_path)
        if not path.is_file():
            raise ConfigError(f"The file {str(path)!r} to upload does not exist or is not a regular file; check the path.")
        with open(path, "rb") as f:
            return self.put_stream(key, f, metadata)

    def get_bytes(self, key: str, expect: ManifestEntry | None = None) -> bytes:
        """The object's bytes; with `expect`, raise IntegrityError unless size and sha256 match."""
        with self.open(key) as f:
            data = f.read()
        _check_expected(key, len(data), hashlib.sha256(data).hexdigest(), expect, self.uri(key))
        return data

    def hash_object(self, key: str) -> ManifestEntry:
        """Read a stored object once and return its entry (size, sha256) without metadata."""
        reader = _HashingReader(self.open(key))
        try:
            while reader.read(_CHUNK):
                pass
        finally:
            reader._stream.close()
        return ManifestEntry(key=key, size=reader.size, sha256=reader.sha256)

    def delete_tree(self, prefix: str) -> None:
        """Delete every object under `prefix`, manifests first, so no reader sees a manifest naming a deleted object."""
        keys = self.list(prefix)
        for key in sorted(keys, key=lambda k: (not _is_manifest(k), k)):
            self.delete(key)

    def write_manifest(
        self, prefix: str, entries: Iterable[ManifestEntry | Mapping[str, Any] | str]
    ) -> Manifest:
        """Publish `<prefix>/manifest.json` listing `entries` (full or prefix-relative keys).

        An entry is a ManifestEntry (as put_* return), a dict with key/size/sha256/metadata, or a bare key (then
        the stored object is read and hashed). Every named object must exist with the recorded size, checked
        before the manifest is written, so a reader never finds a manifest that names a missing object.
        """
        prefix = _check_prefix(prefix)
        resolved: list[ManifestEntry] = []
        for item in entries:
            if isinstance(item, str):
                key = self._entry_key(prefix, item)
                resolved.append(self.hash_object(key) if self.exists(key) else self._missing(key, prefix))
                continue
            if isinstance(item, ManifestEntry):
                entry = item
            else:
                try:
                    entry = ManifestEntry(
                        key=str(item["key"]), size=int(item["size"]), sha256=str(item["sha256"]),
                        metadata=dict(item.get("metadata") or {}),
                    )
                except (KeyError, TypeError, ValueError) as exc:
                    raise ConfigError(
                        f"The manifest entry {item!r} for {prefix!r} lacks key/size/sha256 ({exc}); "
                        "pass the entries that put_bytes/put_file return."
                    ) from exc
            resolved.append(entry.with_key(self._entry_key(prefix, entry.key)))
        if len({e.key for e in resolved}) != len(resolved):
            raise ConfigError(f"The manifest for {prefix!r} names a key twice; give each object once.")
        try:
            json.dumps([e.metadata for e in resolved])
        except TypeError as exc:
            raise ConfigError(f"Manifest metadata for {prefix!r} is not JSON-serialisable ({exc}); use str/int/float/list/dict values.") from exc
        stored = self._list_sizes(prefix)
        for entry in resolved:
            if entry.key not in stored:
                self._missing(entry.key, prefix)
            if stored[entry.key] != entry.size:
                raise IntegrityError(
                    f"The object {self.uri(entry.key)} has {stored[entry.key]} bytes but its manifest entry says "
                    f"{entry.size}; it changed after upload, so the manifest for {prefix!r} was not written."
                )
        manifest = Manifest(prefix=prefix, entries=resolved, created=_now())
        self.put_bytes(_manifest_key(prefix), manifest.to_json().encode())
        return manifest

    def update_manifest(self, prefix: str, entries: Iterable[ManifestEntry | Mapping[str, Any] | str]) -> Manifest:
        """Add or replace entries in the prefix's manifest (resumable stages record each finished shard this way)."""
        old = self.read_manifest(prefix)
        new = list(entries)
        merged: dict[str, ManifestEntry | Mapping[str, Any] | str] = {e.key: e for e in (old.entries if old else [])}
        for item in new:
            raw = item if isinstance(item, str) else (item.key if isinstance(item, ManifestEntry) else str(item.get("key", "")))
            merged[self._entry_key(_check_prefix(prefix), raw)] = item
        return self.write_manifest(prefix, merged.values())

    def read_manifest(self, prefix: str) -> Manifest | None:
        """The manifest at `<prefix>/manifest.json`, or None when there is none yet."""
        prefix = _check_prefix(prefix)
        key = _manifest_key(prefix)
        try:
            data = self.get_bytes(key)
        except ObjectNotFound:
            return None
        return Manifest.from_json(prefix, data, self.uri(key))

    def find_entry(self, key: str) -> ManifestEntry | None:
        """The entry for `key` in the nearest manifest above it, or None when no manifest lists it."""
        key = _check_key(key)
        parts = key.split("/")
        for depth in range(len(parts) - 1, -1, -1):
            manifest = self.read_manifest("/".join(parts[:depth]))
            if manifest is not None and key in manifest:
                return manifest[key]
        return None

    def verify(self, key: str, expect: ManifestEntry | None = None) -> ManifestEntry:
        """Re-read `key` and check it against `expect` or the nearest manifest listing it; raises IntegrityError."""
        expect = expect or self.find_entry(key)
        if expect is None:
            raise IntegrityError(f"No manifest lists {self.uri(key)}, so it cannot be verified; publish it with put_dir or write_manifest.")
        if not self.exists(key):
            raise IntegrityError(f"The manifest names {self.uri(key)} but the object is missing; re-run the stage that wrote it.")
        actual = self.hash_object(key)
        _check_expected(key, actual.size, actual.sha256, expect, self.uri(key))
        return expect

    def verify_manifest(self, prefix: str) -> Manifest:
        """Check every object the prefix's manifest names; raises IntegrityError naming the first bad key."""
        manifest = self.read_manifest(prefix)
        if manifest is None:
            raise IntegrityError(f"There is no manifest at {self.uri(_manifest_key(_check_prefix(prefix)))}; nothing was published there.")
        for entry in manifest:
            self.verify(entry.key, entry)
        return manifest

    def put_dir(self, prefix: str, local_dir: str | os.PathLike, metadata: Mapping[str, Any] | None = None) -> Manifest:
        """Publish a local directory under `prefix`: its files, then its manifest (last).

        Republishing replaces the directory: the old manifest is withdrawn first (a reader meanwhile finds nothing
        rather than a mix of versions), and files the old manifest listed but the new directory lacks are deleted.
        Objects under `prefix` that no manifest of ours listed are left alone.
        """
        prefix = _check_prefix(prefix)
        root = Path(local_dir)
        if not root.is_dir():
            raise ConfigError(f"The directory {str(root)!r} to upload does not exist; check the path.")
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != _CACHE_INDEX)
        if any(p.relative_to(root).as_posix() == MANIFEST_NAME for p in files):
            raise ConfigError(f"{str(root / MANIFEST_NAME)!r} would clash with the store's own manifest; rename that file.")
        old = self.read_manifest(prefix)
        if old is not None:
            self.delete(_manifest_key(prefix))
        entries = [
            self.put_file(_join(prefix, p.relative_to(root).as_posix()), p, metadata) for p in files
        ]
        for gone in set(old.keys() if old else []) - {e.key for e in entries}:
            self.delete(gone)
        return self.write_manifest(prefix, entries)

    def _entry_key(self, prefix: str, key: str) -> str:
        # Entries may name full keys or keys relative to the manifest's prefix.
        if prefix and key.startswith(prefix + "/"):
            return _check_key(key)
        return _join(prefix, _check_key(key))

    def _missing(self, key: str, prefix: str):
        raise StoreError(
            f"The manifest for {prefix!r} names {self.uri(key)}, which does not exist; "
            "upload every object before writing the manifest."
        )


# ---------------------------------------------------------------------------------------------- local folder


class LocalStore(Store):
    """A store in a local folder: keys are paths below the root; writes go through temp file + fsync + rename."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"The store root {str(self.root)!r} is a file, not a folder; point store.root at a folder.")

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def path(self, key: str) -> Path:
        """The local file that holds `key`."""
        return self.root / _check_key(key)

    def uri(self, key: str = "") -> str:
        return str(self.path(key)) if key else str(self.root)

    def put_stream(self, key, stream, metadata=None):
        dest = self.path(key)
        if dest.is_dir():
            raise ConfigError(f"The key {key!r} names a folder in {self.root}; pick a key that is not a folder.")
        size, digest = _atomic_local_write(dest, stream)
        return ManifestEntry(key=key, size=size, sha256=digest, metadata=dict(metadata or {}))

    def put_chunks(self, key, chunks, metadata=None):
        dest = self.path(key)
        if dest.is_dir():
            raise ConfigError(f"The key {key!r} names a folder in {self.root}; pick a key that is not a folder.")
        size, digest = _atomic_local_write_chunks(dest, chunks)
        return ManifestEntry(key=key, size=size, sha256=digest, metadata=dict(metadata or {}))

    def open(self, key):
        path = self.path(key)
        try:
            return open(path, "rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise ObjectNotFound(f"No object {key!r} in the store {self.root}; write it first or check the run name.") from exc

    def get_file(self, key, local_path, expect=None):
        dest = Path(local_path)
        with self.open(key) as src:
            size, digest = _atomic_local_write(dest, src)
        try:
            _check_expected(key, size, digest, expect, self.uri(key))
        except IntegrityError:
            dest.unlink(missing_ok=True)
            raise
        return ManifestEntry(key=key, size=size, sha256=digest, metadata=dict(expect.metadata) if expect else {})

    def exists(self, key):
        return self.path(key).is_file()

    def size(self, key):
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"No object {key!r} in the store {self.root}; write it first or check the run name.") from exc

    def _list_sizes(self, prefix):
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return {}
        out = {}
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if _TMP_MARK in name:
                    continue  # an unfinished write: not an object
                full = Path(dirpath) / name
                try:
                    out[full.relative_to(self.root).as_posix()] = full.stat().st_size
                except FileNotFoundError:
                    pass  # deleted while we walked
        return out

    def delete(self, key):
        path = self.path(key)
        path.unlink(missing_ok=True)
        # Drop folders left empty, up to the root, so list() and the tree stay tidy.
        parent = path.parent
        while parent != self.root and parent.is_relative_to(self.root):
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def clean_partial(self, prefix="", older_than_s=24 * 3600):
        base = self.root / _check_prefix(prefix) if prefix else self.root
        cutoff, removed = time.time() - older_than_s, 0
        for path in base.rglob(f"*{_TMP_MARK}*") if base.is_dir() else []:
            try:
                if path.is_file() and path.stat().st_mtime <= cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                pass  # its writer finished or cleaned up meanwhile
        return removed

    def get_dir(self, prefix, local_dir=None):
        prefix = _check_prefix(prefix)
        manifest = self.read_manifest(prefix)
        if manifest is None:
            raise ObjectNotFound(f"Nothing was published at {self.uri(prefix or '.')} (no {MANIFEST_NAME}); run the stage that writes it.")
        if local_dir is None:
            for entry in manifest:
                self.verify(entry.key, entry)
            return self.root / prefix if prefix else self.root
        dest = Path(local_dir)
        for entry in manifest:
            self.get_file(entry.key, dest / manifest.relative_key(entry.key), expect=entry)
        return dest


# ---------------------------------------------------------------------------------------------- S3


def _endpoint_of(client) -> str:
    return str(getattr(client.meta, "endpoint_url", "") or "")


class S3Store(Store):
    """A store under s3://bucket/prefix through boto3, configured the standard AWS way (env, profile, AWS_ENDPOINT_URL)."""

    def __init__(self, bucket: str, prefix: str = "", client=None, cache_dir: str | os.PathLike | None = None):
        self.bucket = bucket
        self.prefix = _check_prefix(prefix)
        self.client = client if client is not None else _default_client()
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.transfer = _transfer_config()

    def __repr__(self) -> str:
        return f"S3Store({self.uri()!r}, endpoint={_endpoint_of(self.client)!r})"

    def _key(self, key: str) -> str:
        return _join(self.prefix, _check_key(key))

    def uri(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self._key(key) if key else self.prefix}".rstrip("/")

    def check(self) -> "S3Store":
        """Fail early with one clear sentence if the endpoint, credentials or bucket are wrong."""
        with _s3_errors(self, self.uri()):
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
        return self

    def put_stream(self, key, stream, metadata=None):
        full = self._key(key)
        reader = _HashingReader(stream)
        # upload_fileobj streams (multipart above the threshold); an object appears only when the upload completes,
        # and a failed upload is aborted, so a reader never sees part of it.
        with _s3_errors(self, self.uri(key)):
            self.client.upload_fileobj(reader, self.bucket, full, Config=self.transfer)
        return ManifestEntry(key=key, size=reader.size, sha256=reader.sha256, metadata=dict(metadata or {}))

    def open(self, key):
        with _s3_errors(self, self.uri(key)):
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]

    def get_bytes(self, key, expect=None):
        buf = io.BytesIO()
        with _s3_errors(self, self.uri(key)):
            self.client.download_fileobj(self.bucket, self._key(key), buf, Config=self.transfer)
        data = buf.getvalue()
        _check_expected(key, len(data), hashlib.sha256(data).hexdigest(), expect, self.uri(key))
        return data

    def get_file(self, key, local_path, expect=None):
        dest = Path(local_path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}{_TMP_MARK}{uuid.uuid4().hex[:12]}"
        try:
            # Ranged, parallel download by the transfer manager, into a temp name; renamed only once verified.
            with _s3_errors(self, self.uri(key)):
                self.client.download_file(self.bucket, self._key(key), str(tmp), Config=self.transfer)
            size, digest = tmp.stat().st_size, sha256_file(tmp)
            _check_expected(key, size, digest, expect, self.uri(key))
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return ManifestEntry(key=key, size=size, sha256=digest, metadata=dict(expect.metadata) if expect else {})

    def _head(self, key: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            with _s3_errors(self, self.uri(key), missing_ok=True):
                return self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError:
            return None

    def exists(self, key):
        return self._head(key) is not None

    def size(self, key):
        head = self._head(key)
        if head is None:
            raise ObjectNotFound(f"No object at {self.uri(key)}; write it first or check the run name.")
        return int(head["ContentLength"])

    def _list_objects(self, prefix: str) -> dict[str, dict]:
        full = _join(self.prefix, prefix) if prefix else self.prefix
        out: dict[str, dict] = {}
        with _s3_errors(self, self.uri(prefix) if prefix else self.uri()):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=(full + "/") if full else ""
            ):
                for obj in page.get("Contents", []):
                    key = obj["Key"][len(self.prefix) + 1:] if self.prefix else obj["Key"]
                    out[key] = obj
        return out

    def _list_sizes(self, prefix):
        return {k: int(o["Size"]) for k, o in self._list_objects(prefix).items()}

    def delete(self, key):
        with _s3_errors(self, self.uri(key)):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def clean_partial(self, prefix="", older_than_s=24 * 3600):
        full = _join(self.prefix, _check_prefix(prefix)) if prefix else self.prefix
        cutoff = datetime.now(timezone.utc).timestamp() - older_than_s
        removed = 0
        with _s3_errors(self, self.uri(prefix) if prefix else self.uri()):
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=(full + "/") if full else ""
            )
            for page in pages:
                for upload in page.get("Uploads", []):
                    if upload["Initiated"].timestamp() <= cutoff:
                        # Aborting frees the parts an interrupted multipart upload left on the server.
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                        removed += 1
        return removed

    def __getstate__(self):
        # boto3 clients do not pickle; a copy in another process builds its own from that process's AWS config.
        state = dict(self.__dict__)
        state.pop("client", None)
        state.pop("transfer", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.client = _default_client()
        self.transfer = _transfer_config()

    def get_dir(self, prefix, local_dir=None):
        """Download the manifest's objects into `local_dir` or the cache and verify them.

        Each local file is recorded in `.draftline-cache.json` with the object's ETag, size and sha256; a file is
        downloaded again only when the stored object (ETag/size) or its manifest entry changed, or the local copy did.
        """
        prefix = _check_prefix(prefix)
        manifest = self.read_manifest(prefix)
        if manifest is None:
            raise ObjectNotFound(f"Nothing was published at {self.uri(prefix)} (no {MANIFEST_NAME}); run the stage that writes it.")
        dest = Path(local_dir) if local_dir is not None else self._cache_path(prefix)
        dest.mkdir(parents=True, exist_ok=True)
        index_path = dest / _CACHE_INDEX
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError):
            index = {}
        listed = self._list_objects(prefix)
        new_index = {}
        for entry in manifest:
            rel = manifest.relative_key(entry.key)
            obj = listed.get(entry.key)
            if obj is None:
                raise IntegrityError(f"The manifest at {self.uri(prefix)} names {self.uri(entry.key)} but the object is missing; re-run the stage that wrote it.")
            local = dest / rel
            record = {"etag": obj.get("ETag", ""), "size": int(obj["Size"]), "sha256": entry.sha256}
            old = index.get(rel)
            fresh = (
                old is not None and local.is_file()
                and {k: old.get(k) for k in record} == record
                and local.stat().st_size == entry.size
                and old.get("mtime_ns") == local.stat().st_mtime_ns
            )
            if not fresh:
                self.get_file(entry.key, local, expect=entry)
            new_index[rel] = {**record, "mtime_ns": local.stat().st_mtime_ns}
        if local_dir is None:
            # The cache folder is ours: drop files an earlier version of this directory had and this one lacks.
            for rel in set(index) - set(new_index):
                (dest / rel).unlink(missing_ok=True)
        _atomic_local_write(index_path, io.BytesIO(json.dumps(new_index, indent=1).encode()))
        return dest

    def _cache_path(self, prefix: str) -> Path:
        endpoint = re.sub(r"[^A-Za-z0-9.-]+", "_", _endpoint_of(self.client).split("://")[-1]) or "aws"
        return self.cache_dir / "s3" / endpoint / self.bucket / (_join(self.prefix, prefix) or "_root")


def _transfer_config():
    from boto3.s3.transfer import TransferConfig

    # 16 MiB parts: a 100 MB object goes up in 7 parts; S3's 10,000-part limit is then reached only at 160 GB.
    mib16 = 16 * 1024 * 1024
    return TransferConfig(multipart_threshold=mib16, multipart_chunksize=mib16, max_concurrency=4)


def _default_client():
    import boto3
    from botocore.config import Config

    import botocore.session
    from botocore.exceptions import ProfileNotFound

    core = botocore.session.get_session()
    try:
        profile = core.get_scoped_config()
    except ProfileNotFound as exc:
        raise StoreError(
            f"The AWS profile {core.profile!r} (AWS_PROFILE) is not in the AWS config files; "
            "fix AWS_PROFILE or add the profile with `aws configure --profile NAME`.", transient=False,
        ) from exc
    session = boto3.session.Session(botocore_session=core)
    # Standard retries (with backoff) unless the AWS config sets its own; a short connect timeout so that a
    # dead endpoint fails fast.
    retry_set = any(os.environ.get(v) for v in ("AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE")) or any(
        k in profile for k in ("max_attempts", "retry_mode")
    )
    retries = None if retry_set else {"max_attempts": 4, "mode": "standard"}
    config = Config(retries=retries, connect_timeout=5, read_timeout=60)
    client = session.client("s3", config=config)
    endpoint = _endpoint_of(client)
    if endpoint and "amazonaws.com" not in endpoint:
        # Self-hosted S3 (SeaweedFS, MinIO, Ceph) rarely serves bucket-named hostnames: address buckets by path.
        client = session.client("s3", config=config.merge(Config(s3={"addressing_style": "path"})))
    return client


_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "TokenRefreshRequired"}
_TRANSIENT_CODES = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "503", "500", "502", "504", "Throttling"}


class _s3_errors:
    """Turns botocore failures into StoreError with one sentence, marked transient only when a retry may help."""

    def __init__(self, store: S3Store, where: str, missing_ok: bool = False):
        self.store, self.where, self.missing_ok = store, where, missing_ok

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            return False
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import (
            BotoCoreError, ClientError, ConnectionError as BotoConnectionError, NoCredentialsError,
            PartialCredentialsError, ReadTimeoutError,
        )

        endpoint = _endpoint_of(self.store.client) or "the default AWS endpoint"
        if isinstance(exc, S3UploadFailedError):
            # The transfer manager flattens the ClientError into text; recover the error code from it.
            match = re.search(r"\(([A-Za-z0-9]+)\)", str(exc))
            code = match.group(1) if match else ""
            raise self._for_code(code, str(exc), endpoint) from exc
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if self.missing_ok and code in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self._for_code(code, str(exc), endpoint) from exc
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            raise StoreError(
                f"No usable AWS credentials were found for {self.where}; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                "or AWS_PROFILE (never in a config file).", transient=False,
            ) from exc
        if isinstance(exc, (BotoConnectionError, ReadTimeoutError)):
            raise StoreError(
                f"Could not reach the S3 endpoint {endpoint} for {self.where} ({type(exc).__name__}); check that it "
                "is running and that AWS_ENDPOINT_URL points at it.", transient=True,
            ) from exc
        if isinstance(exc, BotoCoreError):
            raise StoreError(f"The S3 request for {self.where} failed: {exc}.", transient=True) from exc
        return False

    def _for_code(self, code: str, detail: str, endpoint: str) -> StoreError:
        bucket = self.store.bucket
        if code in _CREDENTIAL_CODES:
            return StoreError(
                f"Access to {self.where} failed: the S3 endpoint {endpoint} rejected the credentials ({code}); "
                "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE.", transient=False,
            )
        if code in ("AccessDenied", "403", "AllAccessDisabled"):
            return StoreError(
                f"Access to {self.where} was denied ({code}) by {endpoint}; the credentials lack permission for "
                f"bucket {bucket!r}, or are wrong: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE.",
                transient=False,
            )
        if code == "NoSuchBucket":
            return StoreError(
                f"The bucket {bucket!r} does not exist at {endpoint}; create it (e.g. `aws s3 mb s3://{bucket}`) "
                "or fix store.root.", transient=False,
            )
        if code in ("404", "NoSuchKey", "NotFound"):
            return ObjectNotFound(f"No object at {self.where}; write it first or check the run name.")
        transient = code in _TRANSIENT_CODES or code.startswith("5")
        return StoreError(f"The S3 request for {self.where} failed at {endpoint} ({code or 'unknown error'}): {detail}", transient=transient)


# ---------------------------------------------------------------------------------------------- entry points


def open_store(uri: str = "./runs", *, client=None, cache_dir: str | os.PathLike | None = None, check: bool = True) -> Store:
    """Open a store at a local folder or s3://bucket/prefix; S3 is checked at once (endpoint, credentials, bucket)."""
    from draftline.config import _check_store_uri

    try:
        uri = _check_store_uri(str(uri))
    except ValueError as exc:
        raise ConfigError(f"The store location is invalid: {exc}.") from exc
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        store = S3Store(bucket, prefix, client=client, cache_dir=cache_dir)
        return store.check() if check else store
    return LocalStore(uri)


def copy_tree(src: Store, src_prefix: str, dst: Store, dst_prefix: str) -> Manifest | None:
    """Copy every object under `src_prefix` to `dst_prefix` in another (or the same) store, manifests last.

    Objects listed in a source manifest are verified while they are copied (IntegrityError on mismatch); the
    manifests are copied verbatim once all their objects exist at the destination. Returns the destination's
    manifest at `dst_prefix`, if the source had one.
    """
    src_prefix, dst_prefix = _check_prefix(src_prefix), _check_prefix(dst_prefix)
    keys = src.list(src_prefix)
    manifests = [k for k in keys if _is_manifest(k)]
    expected: dict[str, ManifestEntry] = {}
    for mkey in manifests:
        mprefix = mkey[: -len(MANIFEST_NAME)].rstrip("/")
        manifest = src.read_manifest(mprefix)
        if manifest is not None:
            expected.update({e.key: e for e in manifest})

    def target(key: str) -> str:
        return _join(dst_prefix, _relative(src_prefix, key))

    with tempfile.TemporaryDirectory(prefix="draftline-copy-") as tmp:
        staged = Path(tmp) / "object"
        for key in keys:
            if _is_manifest(key):
                continue
            entry = src.get_file(key, staged, expect=expected.get(key))
            written = dst.put_file(target(key), staged)
            _check_expected(target(key), written.size, written.sha256, entry.with_key(target(key)), dst.uri(target(key)))
            staged.unlink(missing_ok=True)
    for mkey in sorted(manifests, key=lambda k: -k.count("/")):
        dst.put_bytes(target(mkey), src.get_bytes(mkey))
    return dst.read_manifest(dst_prefix)


__all__ = [
    "Store", "LocalStore", "S3Store", "Manifest", "ManifestEntry", "ObjectNotFound", "open_store", "copy_tree",
    "sha256_file", "default_cache_dir", "MANIFEST_NAME",
]
