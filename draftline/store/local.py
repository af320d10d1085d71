"""The store in a local folder: keys are paths below its root."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
import uuid
from pathlib import Path

from draftline.errors import ConfigError, IntegrityError
from draftline.store.base import ObjectNotFound, Store, _atomic_local_write, _atomic_local_write_chunks, _fsync_dir
from draftline.store.keys import _TMP_MARK, MANIFEST_NAME, ManifestEntry, _check_expected, _check_key, _check_prefix


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


    # A version is the sha256 of the bytes. Conditional writes hold an exclusive flock on the object's folder, so a
    # read, compare and write by one process is never interleaved with another's (on one machine, or on a shared file
    # system whose locks span machines, such as NFSv4).

    @contextlib.contextmanager
    def _folder_locked(self, key: str):
        folder = self.path(key).parent
        for attempt in range(3):
            folder.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(folder, os.O_RDONLY)
                break
            except FileNotFoundError:  # emptied and removed by a delete_object meanwhile
                if attempt == 2:
                    raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield folder
        finally:
            os.close(fd)  # closing releases the lock

    def _version(self, key: str) -> tuple[bytes, str] | None:
        try:
            data = self.path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return data, hashlib.sha256(data).hexdigest()

    def _staged(self, folder: Path, key: str, data: bytes) -> Path:
        tmp = folder / f".{self.path(key).name}{_TMP_MARK}{uuid.uuid4().hex[:12]}"
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        return tmp

    def create_object(self, key, data):
        with self._folder_locked(key) as folder:
            tmp = self._staged(folder, key, data)
            try:
                os.link(tmp, self.path(key))  # fails when the name exists: never replaces an object
            except FileExistsError:
                return None
            finally:
                tmp.unlink(missing_ok=True)
            _fsync_dir(folder)
        return hashlib.sha256(data).hexdigest()

    def read_object(self, key):
        self.path(key)  # checks the key
        return self._version(key)

    def replace_object(self, key, data, version):
        with self._folder_locked(key) as folder:
            current = self._version(key)
            if current is None or current[1] != version:
                return None
            tmp = self._staged(folder, key, data)
            os.replace(tmp, self.path(key))
            _fsync_dir(folder)
        return hashlib.sha256(data).hexdigest()

    def delete_object(self, key, version):
        with self._folder_locked(key):
            current = self._version(key)
            if current is None or current[1] != version:
                return False
            self.path(key).unlink()
        self.delete(key)  # drops the folders the object leaves empty
        return True
