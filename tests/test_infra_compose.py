"""infra/compose.yaml and the worker images, checked as files: Docker cannot run on the project's machines, so these
tests read the compose file and Dockerfiles and check what a GPU host relies on (nothing here starts a container)."""
from __future__ import annotations

import itertools
import json
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
# What infra/.env must give: every secret compose refuses to start without.
SECRETS = {"POSTGRES_PASSWORD": "pw", "PREFECT_API_AUTH_STRING": "draftline:auth", "S3_ACCESS_KEY": "ak",
           "S3_SECRET_KEY": "sk", "S3_EVAL_ACCESS_KEY": "eak", "S3_EVAL_SECRET_KEY": "esk"}


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
        # Through the auth check, which then becomes `prefect worker start` with the same options.
        assert command[1:2] == ["infra/prefect_worker.py"] and command[0] in ("python", "python3")
        assert command[command.index("--pool") + 1] == pool
        pools_served.add(pool)
    assert pools_in_deployments <= pools_served, "a deployment's pool has no worker in compose.yaml"


def test_prefect_server_runs_on_postgres_and_workers_point_at_it_and_at_s3(compose):
    services = compose["services"]
    env = SECRETS
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
        # The pool that runs only evaluations holds the evaluation identity; the others the pipeline's.
        expected = ("eak", "esk") if service == "worker-sglang" else ("ak", "sk")
        assert (wenv["AWS_ACCESS_KEY_ID"], wenv["AWS_SECRET_ACCESS_KEY"]) == expected, service
        # A child flow run's result is read by its parent on another worker: one shared results volume.
        results = wenv["PREFECT_LOCAL_STORAGE_PATH"]
        assert f"prefect-results:{results}" in worker["volumes"]
        assert worker["depends_on"]["prefect-server"]["condition"] == "service_healthy"


def test_s3_enforces_credentials_from_the_environment(compose):
    seaweed = _interpolate(compose["services"]["seaweedfs"], SECRETS)
    script = " ".join(seaweed["command"])
    assert "-s3.config=/tmp/s3-identities.json" in script and "> /tmp/s3-identities.json" in script
    # $$ is compose's escape: the shell inside the container expands the variables, compose does not.
    assert '"$S3_ACCESS_KEY" "$S3_SECRET_KEY" "$S3_EVAL_ACCESS_KEY" "$S3_EVAL_SECRET_KEY"' in script
    assert seaweed["environment"] == {"S3_ACCESS_KEY": "ak", "S3_SECRET_KEY": "sk", "S3_EVAL_ACCESS_KEY": "eak",
                                      "S3_EVAL_SECRET_KEY": "esk", "DRAFTLINE_BUCKET": "draftline"}


def test_the_evaluation_identity_in_compose_has_the_rules_of_the_s3_policy(compose):
    """The identities file compose's shell writes, filled in as the container's printf would, gives the evaluation
    identity exactly what infra/s3_policy.py gives it (tests/test_s3_policy.py shows SeaweedFS enforcing those)."""
    from infra.s3_policy import seaweedfs_identity

    script = " ".join(compose["services"]["seaweedfs"]["command"])
    fmt = re.search(r"printf '([^']*)'", script).group(1)
    env = {"S3_ACCESS_KEY": "ak", "S3_SECRET_KEY": "sk", "S3_EVAL_ACCESS_KEY": "eak", "S3_EVAL_SECRET_KEY": "esk",
           "DRAFTLINE_BUCKET": "runs"}
    args = [env[name] for name in re.findall(r'"\$\$(\w+)"', script)]
    identities = json.loads(fmt % tuple(args))["identities"]
    assert identities[0]["actions"] == ["Admin", "Read", "List", "Tagging", "Write"]
    evaluation = identities[1]
    assert evaluation == seaweedfs_identity("eak", "esk", "runs", name=evaluation["name"])


def test_the_prefect_api_requires_an_auth_string_that_every_worker_sends(compose):
    services = compose["services"]
    server = _interpolate(services["prefect-server"], SECRETS)
    assert server["environment"]["PREFECT_SERVER_API_AUTH_STRING"] == "draftline:auth"
    for service in WORKERS:
        assert _interpolate(services[service], SECRETS)["environment"]["PREFECT_API_AUTH_STRING"] == "draftline:auth"
    # No default: without it compose refuses to start, in one sentence naming the variable.
    missing = {k: v for k, v in SECRETS.items() if k != "PREFECT_API_AUTH_STRING"}
    for service in ("prefect-server", *WORKERS):
        with pytest.raises(KeyError, match="PREFECT_API_AUTH_STRING: set PREFECT_API_AUTH_STRING in infra/.env"):
            _interpolate(services[service], missing)


def test_published_ports_listen_on_localhost_unless_the_operator_names_an_address(compose):
    published = {name: s["ports"] for name, s in compose["services"].items() if s.get("ports")}
    assert set(published) == {"prefect-server", "seaweedfs"}, "only the server and S3 publish ports"
    for name, ports in published.items():
        for port in _interpolate(ports, SECRETS):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    server = _interpolate(published["prefect-server"], {"PREFECT_BIND": "10.0.0.5", "PREFECT_PORT": "4300"})
    assert server == ["10.0.0.5:4300:4200"]


def test_gpu_workers_request_separate_nvidia_gpus_and_a_large_shm(compose):
    devices = {}
    for service in GPU_WORKERS:
        worker = _interpolate(compose["services"][service], SECRETS)
        (request,) = worker["deploy"]["resources"]["reservations"]["devices"]
        assert request["driver"] == "nvidia" and request["capabilities"] == ["gpu"]
        devices[service] = set(request["device_ids"])
        assert int(worker["shm_size"].removesuffix("gb")) >= 16
    for one, other in itertools.combinations(GPU_WORKERS, 2):
        assert devices[one].isdisjoint(devices[other]), f"{one} and {other} share a GPU"
    assert "deploy" not in compose["services"]["worker-cpu"]


def test_gpu_workers_keep_the_compile_caches_their_image_points_at_in_a_named_volume(compose):
    """The engines' and torch's compile caches and Triton's kernels outlive a worker container's restart: a later
    engine start skips a first start's compilation and kernel warm-up."""
    for service in GPU_WORKERS:
        build = compose["services"][service]["build"]
        image = ((INFRA / build["context"]).resolve() / build["dockerfile"]).read_text()
        folders = re.findall(r"(?:XDG_CACHE_HOME|FLASHINFER_WORKSPACE_BASE|TRITON_CACHE_DIR|TORCHINDUCTOR_CACHE_DIR)=(\S+)",
                             image)
        assert len(folders) == 4
        mounts = dict(v.split(":", 1)[::-1] for v in compose["services"][service]["volumes"])
        assert all(any(Path(f).is_relative_to(m) and mounts[m] in compose["volumes"] for m in mounts) for f in folders)


def test_no_secret_is_committed_and_missing_ones_stop_compose_with_a_clear_message(compose):
    text = (INFRA / "compose.yaml").read_text()
    for name, op, message in _VAR.findall(text):
        if re.search(r"PASSWORD|SECRET|ACCESS_KEY|AUTH_STRING", name):
            assert op == ":?" and "infra/.env" in message, f"${{{name}}} must be required (:?) with a hint"
    with pytest.raises(KeyError, match="S3_SECRET_KEY: set S3_SECRET_KEY in infra/.env"):
        _interpolate(compose["services"]["worker-vllm"], {k: v for k, v in SECRETS.items() if k != "S3_SECRET_KEY"})

    example = _env_example()
    assert set(SECRETS) <= set(example)
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
    assert '"infra/prefect_worker.py"' in cmd and "COPY infra/prefect_worker.py infra/prefect_worker.py" in text
