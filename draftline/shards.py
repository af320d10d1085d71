"""Sharded stage outputs in the store: publish a shard with a completion record, skip verified shards on rerun, write the manifest."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from draftline.errors import ConfigError
from draftline.layout import stage_prefix


def shard_key(run: str, stage: str, index: int, suffix: str) -> str:
    return f"{stage_prefix(run, stage)}/shard-{index:05d}{suffix}"


def _record_key(run: str, stage: str, index: int) -> str:
    # One small record per shard instead of a shared manifest: parallel shard tasks never race on one file.
    return f"{stage_prefix(run, stage)}/_done/shard-{index:05d}.json"


def spec_hash(spec: Any) -> str:
    """Hash of everything that determines a shard's content; a changed spec means the shard is recomputed."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class ShardRecord:
    """What a finished shard looked like when it was published."""

    key: str
    size: int
    sha256: str
    spec: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def manifest_entry(self) -> dict[str, Any]:
        return {"key": self.key, "size": self.size, "sha256": self.sha256, "metadata": self.metadata}


def publish_shard(store, run: str, stage: str, index: int, suffix: str, spec: str, metadata: dict[str, Any],
                  data: bytes | None = None, local_path=None, stream=None, chunks=None) -> ShardRecord:
    """Upload the shard (bytes, a local file, a stream or buffers to concatenate), then its completion record;
    a crash between leaves it unfinished."""
    key = shard_key(run, stage, index, suffix)
    if chunks is not None:
        entry = store.put_chunks(key, chunks)
    elif stream is not None:
        entry = store.put_stream(key, stream)
    elif local_path is not None:
        entry = store.put_file(key, local_path)
    else:
        entry = store.put_bytes(key, data)
    record = ShardRecord(key, entry.size, entry.sha256, spec, metadata)
    store.put_bytes(_record_key(run, stage, index), json.dumps(record.__dict__, sort_keys=True).encode())
    return record


def finished_shard(store, run: str, stage: str, index: int, spec: str, verify: bool = True) -> ShardRecord | None:
    """The record of shard `index` if it was published with this spec and its bytes still match; else None."""
    rkey = _record_key(run, stage, index)
    if not store.exists(rkey):
        return None
    try:
        record = ShardRecord(**json.loads(store.get_bytes(rkey)))
    except (ValueError, TypeError):
        return None
    if record.spec != spec or not store.exists(record.key):
        return None
    if verify:
        stored = store.hash_object(record.key)  # streamed: a multi-GB shard is never held in memory
        if stored.size != record.size or stored.sha256 != record.sha256:
            return None
    return record


def shard_records(store, run: str, stage: str, count: int) -> list[ShardRecord]:
    """Records of shards 0..count-1 (without re-hashing); raise if any is missing, since the stage is then unfinished."""
    records = []
    for i in range(count):
        rkey = _record_key(run, stage, i)
        if not store.exists(rkey):
            raise ConfigError(f"{store.uri(rkey)} is missing: shard {i} of stage {stage!r} never finished; rerun the stage")
        records.append(ShardRecord(**json.loads(store.get_bytes(rkey))))
    return records


def write_stage_manifest(store, run: str, stage: str, records: list[ShardRecord], extra: list[dict] = ()) -> None:
    """Write `<run>/<stage>/manifest.json` listing every shard (key, size, sha256, metadata) plus `extra` entries."""
    store.write_manifest(stage_prefix(run, stage), [r.manifest_entry() for r in records] + list(extra))
