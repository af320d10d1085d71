"""The Store interface and what its backends share: atomic local writes, hashing readers and the cache folder."""
from __future__ import annotations

import hashlib
import io
import json
import os
import queue
import threading
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Mapping

from draftline.errors import ConfigError, IntegrityError, StoreError
from draftline.store.keys import (
    _CHUNK, _TMP_MARK, MANIFEST_NAME, Manifest, ManifestEntry, _check_expected, _check_key, _check_prefix,
    _is_manifest, _join, _manifest_key, _now,
)

# Large local writes start flushing to disk every this many bytes (0: only at the end). Otherwise the page cache
# holds a whole shard until the final fsync, and the disk idles while the writer hashes and copies.
EARLY_WRITEBACK_BYTES = 64 * 1024 * 1024
# Large local writes hash on a second thread while the first copies the same bytes into the file, instead of
# taking turns (on an H200 machine with 8 shard writers: 145k against 140k tokens/s, benchmarks/extract.py). False
# hashes then writes on one thread; kept so that
# tests/test_store.py and benchmarks/extract.py can compare the two.
HASH_ON_THE_SIDE = True
# What get_dir downloaded into a folder (ETag, size, sha256), so a second call fetches only what changed.
_CACHE_INDEX = ".draftline-cache.json"


class ObjectNotFound(StoreError):
    """The key names no object in the store (not transient: the object has to be written first)."""


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
# Every write is atomic (a reader sees the old object, the new one, or none, never a partial one). A manifest is
# written only after every object it names exists, and reads through `get_dir`, `verify` or `expect=` check stored
# bytes against it.


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

    # -- conditional writes: of two writers racing on one key, exactly one succeeds (leases, draftline.run_lock)

    @abstractmethod
    def create_object(self, key: str, data: bytes) -> str | None:
        """Store `data` under `key` only if no object is there: the new object's version, or None (nothing written)
        when one already was."""

    @abstractmethod
    def read_object(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and version, or None when there is none."""

    @abstractmethod
    def replace_object(self, key: str, data: bytes, version: str) -> str | None:
        """Overwrite `key` only while it is still at `version`: the new version, or None (nothing written) when
        another writer changed or removed it meanwhile."""

    @abstractmethod
    def delete_object(self, key: str, version: str) -> bool:
        """Delete `key` only while it is still at `version`; False (nothing deleted) when it changed meanwhile."""

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

