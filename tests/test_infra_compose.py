"""infra/compose.yaml and the worker images, checked as files: Docker cannot run on the project's machines, so these
tests read the compose file and Dockerfiles and check what a GPU host relies on (nothing here starts a container)."""
from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
INFRA = REPO / "infra"
WORKERS = {"worker-cpu": "cpu", "worker-vllm": "gpu-vllm", "worker-sglang": "gpu-sglang", "worker-train": "gpu-train"}
GPU_WORKERS = ("worker-vllm", "worker-sglang", "worker-train")
_VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())


def _interpolate(value, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} substitution, to see what a service really gets."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match):
        name, op, arg = match.groups()
        if env.get(name):
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return arg if op == ":-" else ""

    return _VAR.sub(one, value.replace("$$", "\0")).replace("\0", "$")


def _env_example() -> dict[str, str]:
    return dict(re.findall(r"^(\w+)=(.*)$", (INFRA / ".env.example").read_text(), re.M))


def test_topology_has_postgres_prefect_server_s3_and_one_worker_per_deployment_pool(compose):
    services = compose["services"]
    assert {"postgres", "prefect-server", "seaweedfs", *WORKERS} <= set(services)

    pools_in_deployments = {d["work_pool"]["name"] for d in
                            yaml.safe_load((REPO / "deployments/prefect.yaml").read_text())["deployments"]}
    pools_served = set()
    for service, pool in WORKERS.items():
        command = services[service]["command"]
        assert command[:3] == ["prefect", "worker", "start"]
        assert command[command.index("--pool") + 1] == pool
        pools_served.add(pool)
    assert pools_in_deployments <= pools_served, "a deployment's pool has no worker in compose.yaml"


def test_prefect_server_runs_on_postgres_and_workers_point_at_it_and_at_s3(compose):
    services = compose["services"]
    env = {"POSTGRES_PASSWORD": "pw", "S3_ACCESS_KEY": "ak", "S3_SECRET_KEY": "sk"}
    server = _interpolate(services["prefect-server"], env)
    url = server["environment"]["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
    assert url == "postgresql+asyncpg://prefect:pw@postgres:5432/prefect"
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "postgres-data:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    assert any(v.endswith(":/data") for v in services["seaweedfs"]["volumes"])
    assert {"postgres-data", "seaweedfs-data", "prefect-results"} <= set(compose["volumes"])

    for service in WORKERS:
        worker = _interpolate(services[service], env)
        wenv = worker["environment"]
        assert wenv["PREFECT_API_URL"] == "http://prefect-server:4200/api"
        assert wenv["AWS_ENDPOINT_URL"] == "http://seaweedfs:8333"
        assert (wenv["AWS_ACCESS_KEY_ID"], wenv["AWS_SECRET_ACCESS_KEY"]) == ("ak", "sk")
        # A child flow run's result is read by its parent on another worker: one shared results volume.
        results = wenv["PREFECT_LOCAL_STORAGE_PATH"]
        assert f"prefect-results:{results}" in worker["volumes"]
        assert worker["depends_on"]["prefect-server"]["condition"] == "service_healthy"


def test_s3_enforces_credentials_from_the_environment(compose):
    seaweed = _interpolate(compose["services"]["seaweedfs"], {"S3_ACCESS_KEY": "ak", "S3_SECRET_KEY": "sk"})
    script = " ".join(seaweed["command"])
    assert "-s3.config=/tmp/s3-identities.json" in script and "> /tmp/s3-identities.json" in script
    # $$ is compose's escape: the shell inside the container expands the variables, compose does not.
    assert '"$S3_ACCESS_KEY" "$S3_SECRET_KEY"' in script
    assert seaweed["environment"] == {"S3_ACCESS_KEY": "ak", "S3_SECRET_KEY": "sk"}


def test_gpu_workers_request_separate_nvidia_gpus_and_a_large_shm(compose):
    devices = {}
    for service in GPU_WORKERS:
        worker = _interpolate(compose["services"][service], {"S3_ACCESS_KEY": "a", "S3_SECRET_KEY": "b"})
        (request,) = worker["deploy"]["resources"]["reservations"]["devices"]
        assert request["driver"] == "nvidia" and request["capabilities"] == ["gpu"]
        devices[service] = set(request["device_ids"])
        assert int(worker["shm_size"].removesuffix("gb")) >= 16
    for one, other in itertools.combinations(GPU_WORKERS, 2):
        assert devices[one].isdisjoint(devices[other]), f"{one} and {other} share a GPU"
    assert "deploy" not in compose["services"]["worker-cpu"]


def test_no_secret_is_committed_and_missing_ones_stop_compose_with_a_clear_message(compose):
    text = (INFRA / "compose.yaml").read_text()
    for name, op, message in _VAR.findall(text):
        if re.search(r"PASSWORD|SECRET|ACCESS_KEY", name):
            assert op == ":?" and "infra/.env" in message, f"${{{name}}} must be required (:?) with a hint"
    with pytest.raises(KeyError, match="S3_SECRET_KEY: set S3_SECRET_KEY in infra/.env"):
        _interpolate(compose["services"]["worker-vllm"], {"POSTGRES_PASSWORD": "x", "S3_ACCESS_KEY": "y"})

    example = _env_example()
    assert {"POSTGRES_PASSWORD", "S3_ACCESS_KEY", "S3_SECRET_KEY"} <= set(example)
    assert all(value == "" for value in example.values()), ".env.example must not carry real values"
    tracked = subprocess.run(["git", "ls-files", "infra"], cwd=REPO, capture_output=True, text=True).stdout.split()
    assert "infra/.env" not in tracked


@pytest.mark.parametrize("service", list(WORKERS))
def test_worker_images_install_draftline_and_prefect_for_their_engine(compose, service):
    build = compose["services"][service]["build"]
    dockerfile = (INFRA / build["context"]).resolve() / build["dockerfile"]
    assert dockerfile.is_file() and (INFRA / build["context"]).resolve() == REPO
    text = dockerfile.read_text()
    assert "NOT BUILT" in text  # says plainly it was not built here
    assert "ENV DRAFTLINE_HOME=/opt/draftline" in text
    assert "install-prefect.sh" in text
    # The training image has no engine: torchrun is what it must run.
    engine = {"worker-cpu": "vllm", "worker-vllm": "vllm", "worker-sglang": "sglang",
              "worker-train": "torch.distributed.run"}[service]
    assert re.search(rf'python3? -c "import {engine}, prefect', text), "the image must prove engine + Prefect import"
    if service == "worker-cpu":
        assert '-e ".[cpu]"' in text and "pip uninstall -y torchvision torchaudio torchcodec" in text
    for copied in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (REPO / copied).exists(), f"{dockerfile.name} copies {copied}, which is not in the repository"
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M).group(1)
    assert f'"--pool", "{WORKERS[service]}"' in cmd
