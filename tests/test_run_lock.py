"""One live owner per run name (draftline/run_lock.py), on a local folder and on a real S3 endpoint (SeaweedFS): a
second run of the name is refused at once naming the holder and nothing of the holder's is lost; of runs starting at
once exactly one wins; a retry of the same owner, or anyone once a dead run's lease lapsed, takes the name back; and
what SeaweedFS does with S3's conditional writes (If-None-Match, If-Match)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from draftline.errors import StoreError
from draftline.layout import run_lease_key, training_record_key
from draftline.run_lock import LeaseLost, RunLease, RunNameTaken
from draftline.store import S3Store, open_store


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(str(tmp_path / "runs"))
    return open_store(request.getfixturevalue("s3_uri"))


def _lease(store, owner: str, **kw) -> RunLease:
    return RunLease(store, "demo", owner, label=f"flow run {owner}", stop_hint=f"prefect flow-run cancel {owner}",
                    **kw)


def test_a_second_run_of_the_name_is_refused_at_once_naming_the_holder_and_nothing_of_its_is_lost(store):
    first = _lease(store, "run-1").acquire()
    store.put_bytes(training_record_key("demo"), b'{"steps": 10}')
    lease_before = store.get_bytes(run_lease_key("demo"))

    with pytest.raises(RunNameTaken) as refused:
        _lease(store, "run-2").acquire()
    message = str(refused.value)
    assert message.startswith("the run name 'demo' is taken: flow run run-1 on ")
    assert "`prefect flow-run cancel run-1`" in message and "give this run another name (`run`)" in message
    assert store.get_bytes(run_lease_key("demo")) == lease_before
    assert store.get_bytes(training_record_key("demo")) == b'{"steps": 10}'

    # Released, the name is free for the next run; the run's artifacts stay.
    assert first.release()
    assert not store.exists(run_lease_key("demo"))
    _lease(store, "run-2").acquire()
    assert json.loads(store.get_bytes(run_lease_key("demo")))["owner"] == "run-2"
    assert store.exists(training_record_key("demo"))


def test_of_runs_starting_at_once_exactly_one_gets_the_name(store):
    owners = [f"racer-{i}" for i in range(6)]
    barrier = threading.Barrier(len(owners))
    won, refused = [], []

    def start(owner):
        barrier.wait()
        try:
            _lease(store, owner).acquire()
            won.append(owner)
        except RunNameTaken:
            refused.append(owner)

    threads = [threading.Thread(target=start, args=(o,)) for o in owners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == len(owners) - 1, (won, refused)
    assert json.loads(store.get_bytes(run_lease_key("demo")))["owner"] == won[0]


def test_a_retry_of_the_same_owner_takes_its_name_back_at_once(store):
    """A crashed flow run left its lease fresh; `prefect flow-run retry` runs the same flow run id, which resumes."""
    crashed = _lease(store, "run-1").acquire()
    retry = _lease(store, "run-1").acquire()
    assert retry.took_over["token"] == crashed.token
    with pytest.raises(LeaseLost, match="was taken over by flow run run-1"):
        crashed.renew()
    with pytest.raises(RunNameTaken, match="flow run run-1"):
        _lease(store, "run-2").acquire()


def test_a_dead_runs_lease_lapses_and_then_anyone_takes_the_name(store):
    now = [1000.0]
    dead = _lease(store, "run-1", ttl_s=60, clock=lambda: now[0]).acquire()
    now[0] += 59
    with pytest.raises(RunNameTaken, match=r"lease renewed 59 s ago.*gives the name up 1 s from now"):
        _lease(store, "run-2", clock=lambda: now[0]).acquire()
    now[0] += 2
    successor = _lease(store, "run-2", clock=lambda: now[0]).acquire()
    assert successor.took_over["owner"] == "run-1"
    # The dead run, should it wake up, learns at its next renewal that the name is no longer its own.
    with pytest.raises(LeaseLost, match="taken over by flow run run-2"):
        dead.renew()
    assert not dead.release() and store.exists(run_lease_key("demo"))


def test_a_held_lease_is_renewed_while_its_run_lives_and_released_at_the_end_whatever_the_outcome(store):
    lease = _lease(store, "run-1", ttl_s=0.8)  # renewed every 0.2 s
    with pytest.raises(RuntimeError, match="a stage failed"):
        with lease.held():
            first = json.loads(store.get_bytes(run_lease_key("demo")))["renewed_unix"]
            deadline = time.monotonic() + 60
            while json.loads(store.get_bytes(run_lease_key("demo")))["renewed_unix"] == first:
                assert time.monotonic() < deadline, "the lease was never renewed"
                time.sleep(0.1)
            lease.check()
            raise RuntimeError("a stage failed")
    assert not store.exists(run_lease_key("demo"))


def test_seaweedfs_refuses_conditional_writes_whose_condition_fails(s3_server, s3_uri):
    """What the suite's S3 endpoint (SeaweedFS 4.x) does with S3's conditional writes: If-None-Match: * on an existing
    key and If-Match with a stale ETag (put and delete) are refused with 412 PreconditionFailed and change nothing."""
    from botocore.exceptions import ClientError

    bucket, _, prefix = s3_uri.removeprefix("s3://").partition("/")
    client, key = s3_server.client(), f"{prefix}/k"
    etag = client.put_object(Bucket=bucket, Key=key, Body=b"one", IfNoneMatch="*")["ETag"]
    for call in (lambda: client.put_object(Bucket=bucket, Key=key, Body=b"two", IfNoneMatch="*"),
                 lambda: client.put_object(Bucket=bucket, Key=key, Body=b"two", IfMatch='"0000"'),
                 lambda: client.delete_object(Bucket=bucket, Key=key, IfMatch='"0000"')):
        with pytest.raises(ClientError) as refused:
            call()
        assert refused.value.response["Error"]["Code"] == "PreconditionFailed"
        assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"one"
    assert client.put_object(Bucket=bucket, Key=key, Body=b"two", IfMatch=etag)["ETag"] != etag

    store = open_store(s3_uri)
    assert store.create_object("lease", b"x") is not None and store.conditional_writes is True


class _IgnoresConditions:
    """A boto3 client for an endpoint that ignores If-None-Match / If-Match, as older S3-compatible servers do."""

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if name not in ("put_object", "delete_object"):
            return attr
        return lambda **kw: attr(**{k: v for k, v in kw.items() if k not in ("IfNoneMatch", "IfMatch")})


def test_on_an_endpoint_that_ignores_conditional_writes_the_lease_still_refuses_a_second_run(s3_uri, capsys):
    bucket, _, prefix = s3_uri.removeprefix("s3://").partition("/")
    base = open_store(s3_uri)
    store = S3Store(bucket, prefix, client=_IgnoresConditions(base.client))
    _lease(store, "run-1").acquire()
    assert store.conditional_writes is False
    assert "ignores conditional writes (If-None-Match)" in capsys.readouterr().err
    with pytest.raises(RunNameTaken, match="flow run run-1"):
        _lease(store, "run-2").acquire()


def test_a_store_that_fails_is_a_store_error_not_a_refusal(tmp_path):
    """A lease file that is a folder (a broken store) is not mistaken for a live run."""
    store = open_store(str(tmp_path / "runs"))
    (tmp_path / "runs" / "demo" / "lease.json").mkdir(parents=True)
    with pytest.raises((StoreError, OSError)):
        _lease(store, "run-1").acquire()
