"""The KV cache a vLLM server draftline starts reserves on a CPU: the server settings' env, else the worker's
environment, else 1 GiB, for every kind of server."""
from __future__ import annotations

from pathlib import Path

import pytest

from draftline.config import EngineConfig, ServerSettings
from draftline.engines.vllm import VllmAdapter, capture_server_spec, generation_server_spec

TARGET = Path(__file__).resolve().parents[1] / "assets" / "demo-llama"
KEY = "VLLM_CPU_KVCACHE_SPACE"


def specs(env: dict[str, str], tmp_path: Path) -> dict:
    settings = ServerSettings(env=env)
    return {"traces": generation_server_spec(settings, TARGET, 512),
            "capture": capture_server_spec(settings, TARGET, [2, 4, 5, 8], tmp_path, 512, tmp_path / "norm"),
            "evaluation": VllmAdapter().server_spec(EngineConfig(engine="vllm", env=env), TARGET, None, "t")}


@pytest.mark.parametrize("settings_env, worker_env, expected", [
    ({KEY: "4"}, "2", "4"),  # the server section's env wins: launch lays the server's own env over it
    ({}, "2", "2"),
    ({}, None, "1"),
])
def test_the_kv_cache_size_comes_from_the_settings_then_the_worker(monkeypatch, tmp_path, settings_env, worker_env,
                                                                      expected):
    if worker_env is None:
        monkeypatch.delenv(KEY, raising=False)
    else:
        monkeypatch.setenv(KEY, worker_env)
    for kind, spec in specs(settings_env, tmp_path).items():
        assert spec.env[KEY] == expected, kind
