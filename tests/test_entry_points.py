"""What a user sees when a run fails: a draftline error is one sentence and an exit code at every entry point
(`python -m flows.pipeline`, `draftline run`, Prefect's own failure lines); only a bug prints a traceback, with a
line saying it is one."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from draftline.errors import BUG_LINE

ROOT = Path(__file__).resolve().parents[1]
NO_TRACE = ("draftline: traces: none of the 4 prompts gave a trace (4 longer than traces.max_total_tokens=8 or the "
            "target's context); nothing is left to extract or train on")


def _env(tmp_path: Path) -> dict:
    # A Prefect home of the test's own: the ephemeral server and its result cache start empty.
    return {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}


@pytest.fixture
def failing_mid_run(tmp_path) -> Path:
    """The demo config, shrunk, with a trace limit no prompt fits: every input is valid and present, so the run
    starts, and the trace stage then finds nothing to keep."""
    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    config.update(run="no-traces", store={"root": str(tmp_path / "runs")})
    config["traces"].update(backend="transformers", max_prompts=4, max_new_tokens=8, max_total_tokens=8)
    config["traces"].pop("vllm")
    path = tmp_path / "no-traces.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _assert_one_sentence(res: subprocess.CompletedProcess) -> None:
    output = res.stdout + res.stderr
    assert res.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-6000:]
    assert [line for line in res.stderr.splitlines() if line.startswith("draftline:")] == [NO_TRACE], output[-3000:]


def test_a_stage_failing_mid_run_is_one_sentence_and_exit_1_without_a_traceback(failing_mid_run, tmp_path):
    res = subprocess.run([sys.executable, "-m", "flows.pipeline", str(failing_mid_run)], cwd=ROOT,
                         env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    _assert_one_sentence(res)
    # Prefect's own failure lines carry the same sentence, without the traceback Prefect would add.
    assert "Task run encountered an exception ConfigError: traces: none of the 4 prompts gave a trace" in res.stderr
    # Nothing already written is lost: the shard and the stats stay for the user to read.
    assert (tmp_path / "runs" / "no-traces" / "traces" / "stats.json").exists()


def test_draftline_run_passes_on_the_pipelines_sentence_and_exit_code(failing_mid_run, tmp_path):
    res = subprocess.run([sys.executable, "-m", "draftline.cli", "run", str(failing_mid_run)], cwd=ROOT,
                         env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    _assert_one_sentence(res)


def test_only_a_bug_keeps_its_traceback_in_prefects_failure_lines_and_says_it_is_a_bug(tmp_path):
    script = textwrap.dedent("""
        from prefect import flow, task
        import tasks.common  # installs draftline's logging for Prefect runs, as every flow of draftline does
        from draftline.errors import ConfigError

        @task
        def refuses():
            raise ConfigError("train.max_steps must be positive; set it to 1 or more")

        @task
        def breaks():
            return {}["missing"]

        @flow
        def both():
            refuses(return_state=True)
            breaks(return_state=True)

        both()
    """)
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                         text=True, timeout=600)
    log = res.stderr
    refused = next(line for line in log.splitlines() if "Task run 'refuses" in line and "ConfigError" in line)
    assert "train.max_steps must be positive" in refused
    after_refusal = log.split(refused, 1)[1].split("Task run 'breaks", 1)[0]
    assert "Traceback" not in after_refusal, log[-4000:]
    # The KeyError is a bug: its traceback is there, and the line after Prefect's message says what it means.
    broken = log.split("Task run 'breaks", 1)[1]
    assert "Traceback" in broken and "KeyError: 'missing'" in broken, log[-4000:]
    assert BUG_LINE in broken, log[-4000:]
