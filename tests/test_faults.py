"""Faults of the reliability table (docs/reliability.md) that no other module injects: the S3 server restarted in the
middle of an upload, and a stored trace shard damaged after its stage published it, each met by the real store or the
real CLI."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from draftline.errors import StoreError, is_transient
from draftline.store import open_store
from infra.local.seaweedfs import LocalS3

ROOT = Path(__file__).resolve().parents[1]
# Three 16 MiB parts and a short last one: a multipart upload, paused after its first parts went up.
SIZE = 40 * 1024 * 1024 + 123


class PausedStream:
    """A file-like source that stops at `pause_at` bytes until `resume` is set: the upload is mid-way, parts sent."""

    def __init__(self, data: bytes, pause_at: int):
        self.data, self.pause_at, self.pos = data, pause_at, 0
        self.paused, self.resume = threading.Event(), threading.Event()

    def read(self, n: int = -1) -> bytes:
        if self.pos >= self.pause_at and not self.resume.is_set():
            self.paused.set()
            self.resume.wait(120)
        n = len(self.data) - self.pos if n is None or n < 0 else n
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out


@pytest.mark.s3
def test_an_s3_server_restarted_mid_upload_publishes_nothing_and_the_repeated_write_lands_whole(tmp_path, monkeypatch):
    """The server stops while a multipart upload is half sent: the write fails with one transient sentence (a task's
    retry repeats it), nothing of it is visible and older objects are intact; after the restart the abandoned upload
    is reclaimable and the repeated write stores every byte."""
    data = hashlib.shake_256(b"draftline").digest(SIZE)
    with LocalS3(tmp_path / "s3", keep_data=True) as s3:  # a folder of its own, kept across the restart
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/draftline-test-aws-config")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/draftline-test-aws-credentials")
        for name, value in s3.env().items():
            monkeypatch.setenv(name, value)
        store = open_store(s3.create_bucket("restarts") + "/team/runs")
        store.put_bytes("run/hidden/shard-00000.safetensors", b"published before the restart")

        stream, outcome = PausedStream(data, SIZE // 2), {}

        def upload():
            try:
                outcome["entry"] = store.put_stream("run/hidden/shard-00001.safetensors", stream)
            except Exception as exc:  # noqa: BLE001 - the test reads what the writer met
                outcome["error"] = exc

        writer = threading.Thread(target=upload)
        writer.start()
        assert stream.paused.wait(120), "the upload never reached half-way"
        s3.stop()
        stream.resume.set()
        writer.join(120)
        error = outcome.get("error")
        assert isinstance(error, StoreError), outcome
        uri = store.uri("run/hidden/shard-00001.safetensors")
        # A server caught while shutting down may still answer the part with its own 500 before its port closes.
        assert str(error) == (f"Could not reach the S3 endpoint {s3.endpoint_url} for {uri} (EndpointConnectionError); "
                              "check that it is running and that AWS_ENDPOINT_URL points at it.") or \
            str(error).startswith(f"The S3 request for {uri} failed at {s3.endpoint_url} (InternalError): "), error
        assert is_transient(error)

        s3.start()  # same folder, port and credentials
        assert store.list("run") == ["run/hidden/shard-00000.safetensors"]
        assert store.get_bytes("run/hidden/shard-00000.safetensors") == b"published before the restart"
        assert store.clean_partial("run", older_than_s=0) == 1  # the upload the stop cut off, aborted
        entry = store.put_bytes("run/hidden/shard-00001.safetensors", data)  # what the task's retry does
        assert entry.sha256 == hashlib.sha256(data).hexdigest()
        assert hashlib.sha256(store.get_bytes("run/hidden/shard-00001.safetensors")).hexdigest() == entry.sha256


def test_a_trace_shard_damaged_after_publishing_stops_extraction_with_the_shards_name(tmp_path):
    """`draftline extract` on a run whose trace shard changed after the trace stage published it: one sentence naming
    the shard and the fix, a failed exit, and no hidden-state shard is written from the damaged bytes."""
    store = open_store(str(tmp_path / "runs"))
    trace = {"id": "p1", "input_ids": list(range(1, 41)), "loss_mask": [0] * 10 + [1] * 30, "text": "a trace"}
    key = "faulty/traces/shard-00000.jsonl"
    entry = store.put_bytes(key, (json.dumps(trace) + "\n").encode())
    store.write_manifest("faulty/traces", [entry])
    damaged = bytearray(store.get_bytes(key))
    damaged[20] ^= 0x01  # one bit, same size: a disk fault or a stray tool
    store.path(key).write_bytes(bytes(damaged))

    res = subprocess.run([sys.executable, "-m", "draftline.cli", "extract", "configs/demo.yaml",
                          "--store", str(tmp_path / "runs"), "--run", "faulty"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode != 0, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"draftline: The stored object '{key}' at {store.uri(key)} does not match its manifest"), res.stderr
    assert last.endswith("it was changed or damaged after publishing: re-run the stage that wrote it.")
    assert not [k for k in store.list("faulty/hidden") if k.endswith(".safetensors")]
