"""The engine supervisor against servers that misbehave like real model loads: crash, hang, or never answer."""
from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from draftline.config import EngineConfig
from draftline.engines.launch import ServerSpec, backoff_delay, group_alive, launch, ready_timeout
from draftline.errors import EngineError

SERVER = Path(__file__).with_name("misbehaving_server.py")
REPO = Path(__file__).resolve().parents[1]


def _completion(base_url: str, timeout: float) -> None:
    r = httpx.post(base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=timeout)
    r.raise_for_status()


def _spec(mode: str, tmp_path: Path, *extra: str) -> ServerSpec:
    pids = tmp_path / "pids.jsonl"
    return ServerSpec(
        name=f"fake-{mode}",
        command=lambda port: [sys.executable, str(SERVER), "--port", str(port), "--mode", mode,
                              "--pids", str(pids), "--marker", str(tmp_path / "marker"), *extra],
        first_request=_completion,
    )


def _cfg(**kw) -> EngineConfig:
    base = dict(engine="vllm", ready_timeout_s=30, ready_timeout_s_per_gb=0, no_progress_timeout_s=20,
                first_request_timeout_s=3, retries=0, retry_backoff_s=0.01)
    return EngineConfig(**{**base, **kw})


def _recorded_pids(tmp_path: Path) -> list[dict]:
    path = tmp_path / "pids.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _assert_all_gone(tmp_path: Path, timeout: float = 15.0) -> None:
    """No server, worker or group of any attempt may survive."""
    deadline = time.monotonic() + timeout
    records = _recorded_pids(tmp_path)
    assert records, "the fake server never recorded its pids"
    while time.monotonic() < deadline:
        if not any(group_alive(r["pgid"]) for r in records):
            return
        time.sleep(0.2)
    alive = [r for r in records if group_alive(r["pgid"])]
    raise AssertionError(f"orphan engine processes survived: {alive}")


class RecordingStore:
    """Just enough of the artifact store (contract A) to see which logs were uploaded."""

    def __init__(self):
        self.files: dict[str, bytes] = {}

    def put_file(self, key, local_path):
        self.files[key] = Path(local_path).read_bytes()


def test_healthy_server_answers_and_stop_kills_the_whole_group(tmp_path):
    store = RecordingStore()
    server = launch(_spec("ok", tmp_path, "--ignore-term"), _cfg(), tmp_path / "logs", store=store,
                    log_key_prefix="demo/eval/vllm/logs")
    try:
        assert server.alive()
        _completion(server.base_url, 5)
        rec = _recorded_pids(tmp_path)[0]
        assert rec["pgid"] == server.pgid  # the engine and its worker share the guard's group
    finally:
        server.stop(grace_s=1.0)  # the fake ignores SIGTERM, so this also proves the SIGKILL escalation
    _assert_all_gone(tmp_path)
    log = store.files["demo/eval/vllm/logs/fake-ok-attempt1.log"].decode()
    assert "loading weights" in log and "ready" in log


def test_server_that_exits_during_load_is_retried_with_backoff_and_then_succeeds(tmp_path):
    delays: list[float] = []
    store = RecordingStore()
    cfg = _cfg(retries=2, retry_backoff_s=0.5)
    with launch(_spec("exit-then-ok", tmp_path), cfg, tmp_path / "logs", store=store, log_key_prefix="r/logs",
                rng=random.Random(0), sleep=delays.append) as server:
        _completion(server.base_url, 5)
    assert len(delays) == 1 and 0.5 <= delays[0] <= 1.0  # base x 2^0 x U(1, 2)
    assert "simulated crash during load" in store.files["r/logs/fake-exit-then-ok-attempt1.log"].decode()
    assert "r/logs/fake-exit-then-ok-attempt2.log" in store.files
    _assert_all_gone(tmp_path)


def test_server_that_keeps_exiting_fails_with_its_log_tail_after_all_retries(tmp_path):
    spec = _spec("crash", tmp_path)
    with pytest.raises(EngineError) as info:
        launch(spec, _cfg(retries=1), tmp_path / "logs", sleep=lambda s: None)
    msg = str(info.value)
    assert "after 2 attempt(s)" in msg and "exited with status 3 while loading" in msg
    assert "simulated crash during load" in info.value.log_tail
    _assert_all_gone(tmp_path)


def test_a_load_that_fails_with_the_engines_own_error_is_not_retried_and_names_it(tmp_path):
    """A ValueError in the engine's log (it refuses its input) fails the same way on every load: one attempt, the
    root-cause line in the error's first line (not the wrapper after it), and not transient for the task's retries."""
    sleeps: list[float] = []
    with pytest.raises(EngineError) as info:
        launch(_spec("fatal", tmp_path), _cfg(retries=2), tmp_path / "logs", sleep=sleeps.append)
    first_line = str(info.value).split("\n")[0]
    assert "after 1 attempt(s)" in first_line and sleeps == []
    assert "ValueError: head size 72 is not supported by this attention backend" in first_line
    assert not info.value.transient
    assert not (tmp_path / "logs" / "fake-fatal-attempt2.log").exists()
    _assert_all_gone(tmp_path)


def test_a_load_that_fails_twice_the_same_way_is_not_tried_a_third_time(tmp_path):
    with pytest.raises(EngineError) as info:
        launch(_spec("crash", tmp_path), _cfg(retries=4), tmp_path / "logs", sleep=lambda s: None)
    assert "after 2 attempt(s)" in str(info.value) and not info.value.transient
    _assert_all_gone(tmp_path)


def test_server_that_hangs_silently_in_load_is_killed_by_the_watchdog(tmp_path):
    start = time.monotonic()
    with pytest.raises(EngineError) as info:
        launch(_spec("hang", tmp_path), _cfg(no_progress_timeout_s=2), tmp_path / "logs")
    assert time.monotonic() - start < 15
    assert "printed nothing for 2 s while loading" in str(info.value)
    assert "no_progress_timeout_s in this server's section, traces.vllm, extract.vllm" in str(info.value)
    assert "loading weights" in info.value.log_tail
    _assert_all_gone(tmp_path)


def test_readiness_deadline_grows_with_checkpoint_size_and_is_enforced(tmp_path):
    cfg = _cfg(ready_timeout_s=1, ready_timeout_s_per_gb=2, no_progress_timeout_s=60)
    assert ready_timeout(cfg, 5 * 10**9) == pytest.approx(11.0)
    spec = _spec("hang", tmp_path)
    spec.checkpoint_bytes = 10**9  # 1 s + 2 s/GB x 1 GB = 3 s
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"not ready after 3 s"):
        launch(spec, cfg, tmp_path / "logs")
    assert 2.5 < time.monotonic() - start < 15
    _assert_all_gone(tmp_path)


def test_server_healthy_but_never_answering_is_detected_by_the_first_request(tmp_path):
    with pytest.raises(EngineError) as info:
        launch(_spec("mute", tmp_path), _cfg(first_request_timeout_s=2), tmp_path / "logs")
    assert "reported healthy" in str(info.value) and "first request failed within 2 s" in str(info.value)
    _assert_all_gone(tmp_path)


def test_backoff_is_exponential_with_jitter():
    rng = random.Random(1)
    delays = [backoff_delay(a, 2.0, rng) for a in range(4)]
    for attempt, d in enumerate(delays):
        assert 2.0 * 2**attempt <= d <= 2 * 2.0 * 2**attempt
    assert len({round(d / 2**a, 6) for a, d in enumerate(delays)}) > 1  # jitter: not a fixed multiple


CALLER = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {repo!r})
    from draftline.config import EngineConfig
    from draftline.engines.launch import ServerSpec, launch
    import httpx
    spec = ServerSpec(name="fake-ok",
        command=lambda port: [sys.executable, {server!r}, "--port", str(port), "--mode", "ok",
                              "--pids", {pids!r}],
        first_request=lambda url, t: httpx.post(url + "/v1/completions", json={{}}, timeout=t).raise_for_status())
    server = launch(spec, EngineConfig(engine="vllm", retries=0, first_request_timeout_s=5), {logs!r})
    print("READY", server.pgid, flush=True)
    time.sleep(3600)
""")


def test_no_orphan_survives_when_the_caller_is_sigkilled(tmp_path):
    script = CALLER.format(repo=str(REPO), server=str(SERVER), pids=str(tmp_path / "pids.jsonl"),
                           logs=str(tmp_path / "logs"))
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = caller.stdout.readline()
        assert line.startswith("READY"), f"caller did not start its server: {line!r}"
        pgid = int(line.split()[1])
        assert group_alive(pgid)
        os.kill(caller.pid, signal.SIGKILL)  # no finally, no atexit: only the guard can clean up now
        caller.wait(timeout=10)
    finally:
        if caller.poll() is None:
            caller.kill()
    _assert_all_gone(tmp_path, timeout=20.0)


@pytest.mark.parametrize("mode, said", [
    ("die-serving", "exited with status 1 while serving: RuntimeError: CPU out of memory while allocating"),
    ("killed-serving", "exited with status 137 while serving (killed by SIGKILL, which the kernel's out-of-memory"),
])
def test_a_server_that_dies_while_serving_is_named_with_its_exit_and_cause(tmp_path, mode, said):
    with pytest.raises(EngineError) as info:
        with launch(_spec(mode, tmp_path), _cfg(), tmp_path / "logs") as server:
            _completion(server.base_url, timeout=10)  # the first request answered; this one ends the server
    first_line = str(info.value).split("\n", 1)[0]
    assert first_line.startswith(f"fake-{mode} {said}"), first_line
    assert "(the request saw RemoteProtocolError" in first_line, first_line
    assert info.value.transient  # a machine out of memory may have room on a later attempt
    _assert_all_gone(tmp_path)


def test_a_request_timing_out_on_a_running_server_names_that_server(tmp_path):
    spec = dataclasses.replace(_spec("mute", tmp_path), first_request=lambda url, timeout: None)
    with pytest.raises(EngineError) as info:
        with launch(spec, _cfg(), tmp_path / "logs") as server:
            _completion(server.base_url, timeout=1)  # healthy, but this server never answers a completion
    assert str(info.value).startswith("fake-mute stopped answering while still running (ReadTimeout: "), info.value
    _assert_all_gone(tmp_path)
