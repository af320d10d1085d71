"""Store keys, store URIs and sha256 manifests: how objects are named, checked and recorded."""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterator

from draftline.errors import ConfigError, IntegrityError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "draftline-manifest/1"
_CHUNK = 8 * 1024 * 1024
# Names a write in progress: never valid in a key, so an unfinished object is never listed or read.
_TMP_MARK = ".draftline-tmp-"


# The same rule as check_store_uri, as a JSON-schema pattern: Prefect checks it when a run is submitted.
STORE_URI_PATTERN = r"^(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?|(?![sS]3:)(?!.*://).+)$"


def check_store_uri(value: str) -> str:
    """`value` as a store location (a local path, or s3://bucket/prefix without a trailing '/'); ValueError if malformed."""
    if value.startswith("s3://"):
        rest = value[len("s3://"):]
        bucket = rest.split("/", 1)[0]
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
            raise ValueError(
                f"{value!r} has no valid bucket name; write s3://BUCKET/optional/prefix "
                "with a bucket of 3-63 lowercase letters, digits, dots or dashes"
            )
        return value.rstrip("/")
    if value[:3].lower() == "s3:":
        # "s3:/bucket" or "s3:bucket" would otherwise be a local folder literally named "s3:".
        raise ValueError(f"{value!r} is not a well-formed S3 location; write s3://BUCKET/optional/prefix (two slashes, "
                         "lowercase scheme)")
    if "://" in value:
        raise ValueError(f"{value!r} uses an unsupported scheme; use a local path or s3://bucket/prefix")
    if not value:
        raise ValueError("the store location is empty; use a local path such as ./runs or s3://bucket/prefix")
    return value


# ---------------------------------------------------------------------------------------------- keys
# Keys are '/'-separated paths relative to the store root, laid out as `<run>/<stage>/...`.
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


# ---------------------------------------------------------------------------------------------- sha256


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a local file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_expected(key: str, size: int, sha256: str, expect: ManifestEntry | None, where: str) -> None:
    if expect is None:
        return
    if size != expect.size or sha256 != expect.sha256:
        raise IntegrityError(
            f"The stored object {key!r} at {where} does not match its manifest "
            f"(size {size} vs {expect.size}, sha256 {sha256[:12]} vs {expect.sha256[:12]}); "
            "it was changed or damaged after publishing: re-run the stage that wrote it."
        )


# ---------------------------------------------------------------------------------------------- manifests
# A manifest (`<prefix>/manifest.json`) lists the objects under a prefix with size, sha256 and free-form metadata.
# In manifest.json entry keys are stored relative to the manifest's prefix, so a copied tree stays valid; in
# Python (`ManifestEntry.key`) they are full store keys, like every other key of this API.


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


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

