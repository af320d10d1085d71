"""The Kubernetes GPU pools: each base job template, rendered with a deployment's job variables by Prefect's own
Kubernetes job configuration, gives the Job a GPU node needs; a job variable the template does not use is caught."""
from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def _load_module():
    spec = importlib.util.spec_from_file_location("pool_templates", REPO / "infra/pool_templates.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["pool_templates"] = module
    spec.loader.exec_module(module)
    return module


pool_templates = _load_module()
POOLS = ["gpu-vllm", "gpu-sglang", "gpu-train"]
# Every flow that needs a GPU, by its deployment, and the pool it must land on: the target's stages in vLLM's
# environment, training and the reference decoder beside them in torch's, each engine in its own.
GPU_DEPLOYMENTS = {"generate-traces": "gpu-vllm", "extract-hidden-states": "gpu-vllm", "evaluate-vllm": "gpu-vllm",
                   "evaluate-sglang": "gpu-sglang", "train-drafter": "gpu-train", "reference-acceptance": "gpu-train"}
# The deployments that only evaluate: their pods get the evaluation identity's S3 Secret.
EVALUATIONS = {"evaluate-vllm", "evaluate-sglang", "reference-acceptance"}


def _deployments() -> list[dict]:
    return yaml.safe_load((REPO / "deployments/prefect.yaml").read_text())["deployments"]


def _deployment(name: str) -> dict:
    for deployment in _deployments():
        if deployment["name"] == name:
            return deployment
    raise AssertionError(f"deployments/prefect.yaml has no deployment {name!r}")


def _template(pool: str) -> dict:
    return pool_templates.load_template(REPO / f"infra/k8s/{pool}.json")


def _container(manifest: dict) -> dict:
    return manifest["spec"]["template"]["spec"]["containers"][0]


def _env(manifest: dict) -> dict:
    return {e["name"]: e.get("value") for e in _container(manifest)["env"]}


@pytest.fixture(scope="module")
def k8s_config_cls():
    # Fails (never skips) without prefect-kubernetes: the dev environment must be able to check the templates.
    return pool_templates.job_configuration_class("kubernetes")


def test_every_flow_that_needs_a_gpu_is_deployed_on_a_gpu_pool_and_only_those():
    on_gpu = {d["name"]: d["work_pool"]["name"] for d in _deployments() if d["work_pool"]["name"].startswith("gpu-")}
    assert on_gpu == GPU_DEPLOYMENTS
    # What stays on cpu only composes and waits on the runs above.
    assert {d["name"] for d in _deployments()} - set(on_gpu) == {"pipeline", "evaluate", "nightly"}
    for name in ("pipeline", "evaluate", "nightly"):
        assert _deployment(name)["parameters"]["stage_runs"] == "deployments"
        assert _deployment(name)["parameters"]["engine_runs"] == "deployments"


def test_the_scheduled_runs_read_the_same_config_file_as_make_demo():
    """The pipeline and the nightly deployments name configs/demo.yaml rather than a copy of it that drifts."""
    from draftline.config import PipelineConfig
    from draftline.config_loading import load_config

    for name in ("pipeline", "nightly"):
        config_file = _deployment(name)["parameters"]["config_file"]
        assert config_file == "configs/demo.yaml"
        assert isinstance(load_config(REPO / config_file, PipelineConfig), PipelineConfig)
        assert "config" not in _deployment(name)["parameters"]


@pytest.mark.parametrize("name", sorted(GPU_DEPLOYMENTS))
def test_deployment_job_variables_render_into_a_gpu_job(name, k8s_config_cls):
    deployment = _deployment(name)
    pool = deployment["work_pool"]["name"]
    job_variables = {**deployment["work_pool"].get("job_variables", {}),
                     "env": {"DRAFTLINE_STORE": "s3://draftline-runs/team"}}

    config = pool_templates.render(_template(pool), job_variables, "kubernetes",
                                   deployment_name=deployment["name"])
    manifest = config.job_manifest
    container = _container(manifest)
    pod = manifest["spec"]["template"]["spec"]

    assert manifest["kind"] == "Job"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == job_variables.get("gpus", 1)
    assert container["image"] == job_variables["image"]
    env = _env(manifest)
    assert env["DRAFTLINE_STORE"] == "s3://draftline-runs/team"
    # The evicted-pod contract: Kubernetes does not retry, Prefect reschedules the flow run.
    assert manifest["spec"]["backoffLimit"] == 0
    assert env["PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"] == "reschedule"
    assert pod["restartPolicy"] == "Never"
    # Engines need a large in-memory /dev/shm; Docker's and Kubernetes' default of 64 MB breaks them.
    shm = {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"].endswith("Gi") and int(shm["sizeLimit"][:-2]) >= 16
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    # Credentials come from a Kubernetes Secret, never from the template or the deployment; evaluations get the
    # evaluation identity's, which writes only <run>/eval/ and <run>/regression/.
    secret = "draftline-s3-eval" if name in EVALUATIONS else "draftline-s3"
    assert container["envFrom"] == [{"secretRef": {"name": secret, "optional": False}},
                                    {"secretRef": {"name": "draftline-prefect-auth", "optional": False}}]
    assert not any("SECRET" in name or "PASSWORD" in name for name in env)
    # Engine and torch images are tens of GB: the worker must wait for the pod longer than Prefect's default 60 s.
    assert config.pod_watch_timeout_seconds >= 900
    assert container["args"][:3] == ["prefect", "flow-run", "execute"]


# FlashInfer's JIT kernels (its own variable, not XDG_CACHE_HOME) are what a first vLLM start spent 74 s building.
CACHE_ENV = ("XDG_CACHE_HOME", "FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


@pytest.mark.parametrize("pool", POOLS)
def test_gpu_pods_keep_the_compile_caches_the_image_points_at_in_a_folder_of_the_node(pool, k8s_config_cls):
    """A pod per flow run starts with an empty home folder, so without a kept folder every engine start would be a
    machine's first (its kernels compiled again: 138-219 s against 38-81 s measured for vLLM)."""
    image = (REPO / f"infra/images/worker-{pool.removeprefix('gpu-')}.Dockerfile").read_text()
    env = dict(re.findall(rf"({'|'.join(CACHE_ENV)})=(\S+)", image))
    assert set(env) == set(CACHE_ENV)
    manifest = pool_templates.render(_template(pool), {"engine_cache_path": "/mnt/nvme/draftline-cache"},
                                     deployment_name="any").job_manifest
    volume = {v["name"]: v for v in manifest["spec"]["template"]["spec"]["volumes"]}["engine-cache"]
    assert volume["hostPath"] == {"path": "/mnt/nvme/draftline-cache", "type": "DirectoryOrCreate"}
    mount = {m["name"]: m["mountPath"] for m in _container(manifest)["volumeMounts"]}["engine-cache"]
    assert all(Path(folder).is_relative_to(mount) for folder in env.values())
    default = pool_templates.render(_template(pool), {}, deployment_name="any").job_manifest
    assert {v["name"]: v for v in default["spec"]["template"]["spec"]["volumes"]}["engine-cache"]["hostPath"]["path"]


@pytest.mark.parametrize("stage,name", [("traces", "generate-traces"), ("extract", "extract-hidden-states"),
                                        ("train", "train-drafter"), ("reference", "reference-acceptance")])
def test_the_gpus_a_config_asks_for_become_the_pods_gpu_limit(stage, name, k8s_config_cls):
    """The pipeline starts each stage's run with job variable gpus from the config (flows/deployed.py); for the 8-GPU
    example that is a pod with 8 GPUs for the target's stages and training, one for the reference decoder."""
    from draftline.config_loading import load_config
    from draftline.stages import stage_gpus

    config = load_config(REPO / "configs/kimi-k2.5.yaml")
    gpus = stage_gpus(config, stage)
    assert gpus == (1 if stage == "reference" else 8)
    deployment = _deployment(name)
    job_variables = {**deployment["work_pool"]["job_variables"], "gpus": gpus}
    manifest = pool_templates.render(_template(deployment["work_pool"]["name"]), job_variables,
                                     deployment_name=name).job_manifest
    assert _container(manifest)["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert _container(manifest)["resources"]["requests"]["nvidia.com/gpu"] == gpus


def test_job_variables_override_the_template_defaults(k8s_config_cls):
    config = pool_templates.render(
        _template("gpu-vllm"),
        {"gpus": 4, "image": "registry.example/draftline-vllm:0.25", "shm_size": "64Gi", "namespace": "ml",
         "node_selector": {"node.kubernetes.io/instance-type": "h200x8"}, "memory_limit": "512Gi"},
    )
    manifest = config.job_manifest
    container = _container(manifest)
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 4, "memory": "512Gi"}
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert container["image"] == "registry.example/draftline-vllm:0.25"
    assert manifest["metadata"]["namespace"] == "ml"
    assert manifest["spec"]["template"]["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "h200x8"}
    assert manifest["spec"]["template"]["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] == "64Gi"


def test_a_misspelt_job_variable_is_caught_although_prefect_drops_it_silently(k8s_config_cls):
    template = _template("gpu-vllm")
    job_variables = {"gpu_count": 8, "image": "draftline/worker-vllm:latest"}

    # What Prefect itself does: renders happily, with the default of 1 GPU and no trace of gpu_count.
    config = pool_templates.render(template, job_variables, strict=False)
    assert _container(config.job_manifest)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "gpu_count" not in json.dumps(config.model_dump(mode="json"))

    assert pool_templates.dropped_job_variables(template, job_variables, k8s_config_cls) == ["gpu_count"]
    with pytest.raises(pool_templates.TemplateProblem, match="gpu_count"):
        pool_templates.render(template, job_variables)


def test_a_declared_variable_the_job_never_uses_is_reported(k8s_config_cls):
    template = _template("gpu-sglang")
    assert pool_templates.check_template(template, k8s_config_cls, "gpu-sglang.json") == []

    declared_only = copy.deepcopy(template)
    declared_only["variables"]["properties"]["gpu_type"] = {"type": "string", "default": "h200"}
    # Referenced, but under a job_configuration key the Kubernetes worker's configuration class ignores.
    declared_only["job_configuration"]["gpu_type"] = "{{ gpu_type }}"
    problems = pool_templates.check_template(declared_only, k8s_config_cls, "gpu-sglang.json")
    assert len(problems) == 1 and "'gpu_type'" in problems[0] and "gpu-sglang.json" in problems[0]
    assert pool_templates.dropped_job_variables(declared_only, {"gpu_type": "b200"}, k8s_config_cls) == ["gpu_type"]

    # Referenced inside the Job manifest, it reaches the Job.
    declared_only["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["priorityClassName"] = (
        "gpu-{{ gpu_type }}")
    assert pool_templates.check_template(declared_only, k8s_config_cls, "gpu-sglang.json") == []
    manifest = pool_templates.render(declared_only, {"gpu_type": "b200"}).job_manifest
    assert manifest["spec"]["template"]["spec"]["priorityClassName"] == "gpu-b200"


@pytest.mark.parametrize("pool", POOLS)
def test_templates_pass_the_prefect_servers_own_validation(pool):
    from prefect.server.schemas.actions import validate_base_job_template
    from prefect.utilities.schema_tools.validation import is_valid_schema, validate

    template = _template(pool)
    validate_base_job_template(template)  # every placeholder is a declared variable
    is_valid_schema(template["variables"], preprocess=False)
    defaults = {k: v["default"] for k, v in template["variables"]["properties"].items() if v.get("default") is not None}
    validate(defaults, template["variables"], raise_on_error=True, preprocess=True, ignore_required=True)
    with pytest.raises(Exception, match="gpus"):
        validate({"gpus": "two"}, template["variables"], raise_on_error=True, preprocess=True, ignore_required=True)


def test_a_template_that_would_drop_the_gpu_count_the_flows_set_is_reported(k8s_config_cls):
    template = _template("gpu-train")
    assert pool_templates.check_run_time_variables(template, k8s_config_cls, "gpu-train.json") == []

    fixed = copy.deepcopy(template)
    resources = fixed["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    resources["limits"]["nvidia.com/gpu"] = resources["requests"]["nvidia.com/gpu"] = 1
    (problem,) = pool_templates.check_run_time_variables(fixed, k8s_config_cls, "gpu-train.json")
    assert "gpu-train.json" in problem and "'gpus'" in problem and "drop it silently" in problem


def test_the_check_command_passes_on_the_repository_and_fails_on_a_dropped_variable(tmp_path, capsys):
    assert pool_templates.main(["check"]) == 0

    spec = yaml.safe_load((REPO / "deployments/prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        if deployment["name"] == "evaluate-vllm":
            deployment["work_pool"]["job_variables"] = {"gpu": 2}
    bad = tmp_path / "prefect.yaml"
    bad.write_text(yaml.safe_dump(spec))
    capsys.readouterr()
    assert pool_templates.main(["check", "--prefect-file", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "'evaluate-vllm'" in err and "'gpu'" in err and "drop it silently" in err


def test_in_cluster_workers_serve_each_gpu_pool_and_may_create_jobs_where_the_templates_put_them():
    docs = [d for d in yaml.safe_load_all((REPO / "infra/k8s/workers.yaml").read_text()) if d]
    by_kind: dict[str, list[dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    (role,) = by_kind["Role"]
    (binding,) = by_kind["RoleBinding"]
    can_create_jobs = any("batch" in r["apiGroups"] and "jobs" in r["resources"] and "create" in r["verbs"]
                          for r in role["rules"])
    assert can_create_jobs
    served, process_workers = {}, {}
    for deployment in by_kind["Deployment"]:
        pod = deployment["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        pool = args[args.index("--pool") + 1]
        if args[args.index("--type") + 1] == "process":
            process_workers[pool] = pod["containers"][0]
            continue
        assert args[args.index("--type") + 1] == "kubernetes"
        served[pool] = deployment["metadata"]["namespace"]
        assert pod["serviceAccountName"] == binding["subjects"][0]["name"]
    assert set(served) == set(POOLS)
    # The pool of the flows that compose and wait (no image of their own): a process worker in the draftline image
    # runs them in its pod, and they reach the run's store.
    composing = {d["work_pool"]["name"] for d in _deployments() if "image" not in d["work_pool"]["job_variables"]}
    assert set(process_workers) == composing == {"cpu"}
    cpu = process_workers["cpu"]
    assert cpu["image"] == "draftline/worker-cpu:latest"
    assert "-t draftline/worker-cpu:latest" in (REPO / "infra/images/worker-cpu.Dockerfile").read_text()
    assert {"secretRef": {"name": "draftline-s3"}} in cpu["envFrom"]
    for pool in POOLS:
        job_namespace = _template(pool)["variables"]["properties"]["namespace"]["default"]
        assert served[pool] == job_namespace == role["metadata"]["namespace"]


def _worker_deployments() -> list[dict]:
    return [d for d in yaml.safe_load_all((REPO / "infra/k8s/workers.yaml").read_text())
            if d and d["kind"] == "Deployment"]


def test_in_cluster_workers_take_the_auth_string_from_a_secret_and_start_through_the_auth_check(monkeypatch):
    for deployment in _worker_deployments():
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert env["PREFECT_API_AUTH_STRING"]["valueFrom"] == {
            "secretKeyRef": {"name": "draftline-prefect-auth", "key": "PREFECT_API_AUTH_STRING"}}
        assert "value" not in env["PREFECT_API_AUTH_STRING"]
        args = container["args"]
        if args[args.index("--type") + 1] == "process":  # the cpu pool's worker creates no Jobs
            assert not any(name.startswith("PREFECT_INTEGRATIONS_KUBERNETES") for name in env)
        else:
            _jobs_get_the_auth_secret(env, monkeypatch)
        # It starts through infra/prefect_worker.py, mounted from a ConfigMap made of that file.
        mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["worker-start"]
        assert args[:2] == ["python", f"{mount}/prefect_worker.py"]
        assert {v["name"]: v for v in pod["volumes"]}["worker-start"]["configMap"]["name"] == "draftline-worker-start"
    header = (REPO / "infra/k8s/workers.yaml").read_text()
    assert "create configmap draftline-worker-start --from-file=infra/prefect_worker.py" in header
    assert "create secret generic draftline-prefect-auth" in header
    # The namespace exists before anything is created in it.
    assert header.index("kubectl create namespace draftline") < header.index("kubectl -n draftline create")


def _jobs_get_the_auth_secret(env: dict, monkeypatch) -> None:
    """The Kubernetes worker hands the Jobs it creates the auth Secret as a reference (prefect-kubernetes' settings)."""
    from prefect_kubernetes.settings import KubernetesSettings

    for name in ("PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET_NAME",
                 "PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET_KEY"):
        monkeypatch.setenv(name, env[name]["value"])
    settings = KubernetesSettings().worker
    assert (settings.api_auth_string_secret_name, settings.api_auth_string_secret_key) == (
        "draftline-prefect-auth", "PREFECT_API_AUTH_STRING")


def test_a_jobs_auth_string_is_a_secret_reference_not_a_value_in_its_manifest(k8s_config_cls):
    """What the worker does to each Job with the settings above, by prefect-kubernetes' own code: the auth string the
    worker's settings put into the Job's env becomes a reference to the Secret."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
    from prefect_kubernetes.worker import KubernetesWorker

    with temporary_settings(updates={PREFECT_API_AUTH_STRING: "draftline:do-not-leak",
                                     PREFECT_API_URL: "http://prefect.example/api"}):
        config = pool_templates.render(_template("gpu-vllm"), {}, deployment_name="evaluate-vllm")
    assert _env(config.job_manifest)["PREFECT_API_AUTH_STRING"] == "draftline:do-not-leak"  # before the worker's step
    import asyncio

    # The method uses nothing of the worker but its arguments.
    asyncio.run(KubernetesWorker._replace_env_variable_with_secret(
        None, env_variable_name="PREFECT_API_AUTH_STRING", configuration=config,
        secret_name="draftline-prefect-auth", secret_key="PREFECT_API_AUTH_STRING"))
    env = {e["name"]: e for e in _container(config.job_manifest)["env"]}
    assert env["PREFECT_API_AUTH_STRING"] == {"name": "PREFECT_API_AUTH_STRING", "valueFrom": {
        "secretKeyRef": {"name": "draftline-prefect-auth", "key": "PREFECT_API_AUTH_STRING"}}}
    assert "do-not-leak" not in json.dumps(config.job_manifest)


def test_the_evaluation_policy_in_the_repository_is_the_one_s3_policy_writes():
    from infra.s3_policy import EVALUATION_WRITES, iam_policy

    committed = json.loads((REPO / "infra/k8s/s3-evaluation-policy.json").read_text())
    assert committed == iam_policy("draftline", "team")
    (write,) = [s for s in committed["Statement"] if s["Sid"] == "WriteEvaluationsOnly"]
    assert write["Resource"] == [f"arn:aws:s3:::draftline/team/{p}" for p in EVALUATION_WRITES]
    assert all("/train" not in r and "/export" not in r for r in write["Resource"])
