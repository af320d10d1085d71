"""Task policy against a real Prefect server: bad input is never retried, transient engine failures are."""
import pytest
from prefect import flow, task
from prefect.settings import PREFECT_API_URL, temporary_settings

from draftline.errors import ConfigError, EngineError, StoreError
from tasks.common import artifact_key, transient_retries


@pytest.mark.prefect
@pytest.mark.parametrize("error,expected_attempts", [
    (ConfigError("train.max_steps=0 is invalid"), 1),
    (StoreError("the S3 endpoint rejected the credentials", transient=False), 1),
    (EngineError("vLLM exited during load", transient=True), 3),
    (StoreError("connection reset by the S3 endpoint", transient=True), 3),
])
def test_only_transient_failures_are_retried(prefect_server, error, expected_attempts):
    attempts = []

    @task(**transient_retries(retries=2, base_delay_s=0))
    def failing_step():
        attempts.append(1)
        raise error

    @flow
    def one_step():
        return failing_step(return_state=True)

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        state = one_step(return_state=True)
    assert state.is_failed()
    assert len(attempts) == expected_attempts


def test_artifact_keys_are_valid_prefect_keys():
    assert artifact_key("Demo_Run", "eval summary") == "demo-run-eval-summary"


@pytest.mark.prefect
def test_cache_serves_reruns_until_the_runs_artifacts_are_deleted(prefect_server, tmp_path):
    """A rerun is served from cache; deleting the run's folder in the store makes the next run compute again."""
    import shutil

    from draftline.config import load_config
    from tasks.common import CACHED

    config = load_config("configs/demo.yaml").model_copy(
        update={"store": load_config("configs/demo.yaml").store.model_copy(update={"root": str(tmp_path / "runs")})})
    executions = []

    @task(cache_policy=CACHED, persist_result=True)
    def stage(config):
        executions.append(1)
        return len(executions)

    @flow
    def pipeline(config):
        return stage(config)

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        pipeline(config)
        pipeline(config)
        assert len(executions) == 1
        shutil.rmtree(tmp_path / "runs" / config.run)
        pipeline(config)
    assert len(executions) == 2
