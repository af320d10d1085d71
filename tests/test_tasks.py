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

    from draftline.config_loading import load_config
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


@pytest.mark.prefect
def test_a_markdown_artifacts_plots_are_inlined_and_render_in_the_ui(prefect_server, tmp_path):
    """The report's `![..](plot.png)` images, read from the store and inlined as data URIs: the Prefect UI (headless
    Chromium) shows them as images of the plot's size, not as broken links to a file it cannot reach."""
    import asyncio
    import base64
    import io
    import re
    import subprocess
    import tempfile

    from matplotlib.figure import Figure
    from prefect.client.orchestration import get_client

    from draftline.store import open_store
    from tasks.common import publish_markdown

    store = open_store(str(tmp_path / "store"))
    png = io.BytesIO()
    fig = Figure(figsize=(4, 3), dpi=50)
    fig.add_subplot().plot([1, 3, 2])
    fig.savefig(png, format="png")
    store.put_bytes("run/eval/report/acceptance.png", png.getvalue())
    markdown = "# Report\n\n![acceptance by position](acceptance.png)\n\n![missing](nowhere.png)\n"

    @flow
    def publish():
        publish_markdown("inline-plot-report", markdown, "a report", images_from=(store, "run/eval/report"))

    async def latest():
        async with get_client() as client:
            return await client.read_latest_artifacts()

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        publish()
        artifact = next(a for a in asyncio.run(latest()) if a.key == "inline-plot-report")
    data = re.search(r"!\[acceptance by position\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", artifact.data)
    assert data and base64.b64decode(data.group(1)) == png.getvalue(), artifact.data[:300]
    assert "![missing](nowhere.png)" in artifact.data  # not in the store: left as written

    page = f"{prefect_server.api_url.removesuffix('/api')}/artifacts/artifact/{artifact.latest_id}"
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          "--window-size=1600,1200",
                          f"--user-data-dir={tempfile.mkdtemp(prefix='chromium-')}", "--virtual-time-budget=30000",
                          "--dump-dom", page], capture_output=True, text=True, timeout=120).stdout
    images = re.findall(r"<img[^>]*>", dom)
    assert any('src="data:image/png;base64,' in img and 'alt="acceptance by position"' in img for img in images), (
        images or dom[-2000:])
