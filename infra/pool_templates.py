"""Render Prefect work-pool base job templates with a deployment's job variables (through Prefect's own code) and
find job variables that Prefect would silently drop.

Prefect accepts any job variable a deployment sets, but a variable reaches the flow run's infrastructure only if
the pool's template declares it AND references it (as `{{ name }}`) in a part of `job_configuration` that the
worker reads; anything else vanishes without a word. This module makes that loud:

    python infra/pool_templates.py check                 # deployments/prefect.yaml against infra/k8s/*.json
    python infra/pool_templates.py render gpu-vllm --var gpus=2   # the Kubernetes Job the worker would create
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
# The GPU pools of the team deployment: pool name -> (worker type, base job template).
KUBERNETES_POOLS = {
    "gpu-vllm": ("kubernetes", REPO / "infra/k8s/gpu-vllm.json"),
    "gpu-sglang": ("kubernetes", REPO / "infra/k8s/gpu-sglang.json"),
    "gpu-train": ("kubernetes", REPO / "infra/k8s/gpu-train.json"),
}
# Job variables the flows set on every flow run they start on a GPU pool (flows/deployed.py: the GPU count the config
# asks for); a template that dropped one would silently give every such run its default.
RUN_TIME_JOB_VARIABLES = ("gpus",)


class TemplateProblem(ValueError):
    """A job template or a deployment's job variables that would not do what they say."""


def job_configuration_class(worker_type: str):
    """The job-configuration class of a worker type (e.g. process, kubernetes), as the worker itself uses it."""
    from prefect.workers.base import BaseWorker

    if worker_type == "kubernetes":
        # Imported for its side effect: it registers the worker type.
        import prefect_kubernetes.worker  # noqa: F401
    worker = BaseWorker.get_worker_class_from_type(worker_type)
    if worker is None:
        raise TemplateProblem(
            f"worker type {worker_type!r} is not installed here; install its Prefect integration "
            f"(e.g. pip install prefect-kubernetes) to check or render its templates"
        )
    return worker.job_configuration


def load_template(path: str | Path) -> dict[str, Any]:
    """Read a base job template (JSON with `job_configuration` and `variables`) and check its shape."""
    path = Path(path)
    try:
        template = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TemplateProblem(f"{path}: not a readable JSON base job template ({exc}); fix the file") from None
    if not isinstance(template, dict) or not {"job_configuration", "variables"} <= template.keys():
        raise TemplateProblem(f"{path}: a base job template needs the keys job_configuration and variables; add them")
    return template


def _referenced_names(template: dict[str, Any], config_cls) -> set[str]:
    """Variables referenced where the worker looks: inside job_configuration keys that are fields of its class."""
    from prefect.utilities.templating import PlaceholderType, find_placeholders

    fields = set(config_cls.model_fields)
    names: set[str] = set()
    for key, value in template["job_configuration"].items():
        if key not in fields:
            continue  # the worker's configuration class ignores this key, and every placeholder in it
        for placeholder in find_placeholders(json.dumps(value)):
            if placeholder.type is PlaceholderType.STANDARD:
                names.add(placeholder.name.split(".", 1)[0])
    return names


def unreferenced_variables(template: dict[str, Any], config_cls) -> list[str]:
    """Variables the template declares but never passes on to the worker: setting them would do nothing."""
    declared = set(template["variables"].get("properties", {}))
    return sorted(declared - _referenced_names(template, config_cls))


def dropped_job_variables(template: dict[str, Any], job_variables: dict[str, Any], config_cls) -> list[str]:
    """Job variables (dotted keys count by their first part) that Prefect would silently drop with this template."""
    declared = set(template["variables"].get("properties", {}))
    used = _referenced_names(template, config_cls) & declared
    return sorted({key.split(".", 1)[0] for key in job_variables} - used)


def check_template(template: dict[str, Any], config_cls, where: str) -> list[str]:
    """One sentence per declared variable that would be silently dropped."""
    return [
        f"{where}: variable {name!r} is declared but not referenced in job_configuration (where the worker reads); "
        f"reference it as '{{{{ {name} }}}}' in the job manifest or remove it"
        for name in unreferenced_variables(template, config_cls)
    ]


def check_run_time_variables(template: dict[str, Any], config_cls, where: str) -> list[str]:
    """One sentence per job variable the flows set at run time that this template would drop."""
    return [
        f"{where}: the flows set job variable {name!r} on every run they start on this pool, but the template does "
        f"not use it, so Prefect would drop it silently; declare it and reference it as '{{{{ {name} }}}}' in the "
        f"job manifest"
        for name in dropped_job_variables(template, dict.fromkeys(RUN_TIME_JOB_VARIABLES), config_cls)
    ]


def check_deployments(prefect_file: str | Path, pools: dict[str, tuple[str, Path]] = KUBERNETES_POOLS) -> list[str]:
    """One sentence per job variable in a prefect.yaml deployment that its pool's template would drop."""
    prefect_file = Path(prefect_file)
    spec = yaml.safe_load(prefect_file.read_text()) or {}
    problems = []
    for deployment in spec.get("deployments") or []:
        pool = deployment.get("work_pool") or {}
        if pool.get("name") not in pools:
            continue
        worker_type, template_path = pools[pool["name"]]
        template = load_template(template_path)
        config_cls = job_configuration_class(worker_type)
        for name in dropped_job_variables(template, pool.get("job_variables") or {}, config_cls):
            problems.append(
                f"{prefect_file}: deployment {deployment.get('name')!r} sets job variable {name!r}, which the "
                f"{pool['name']} pool's template ({template_path.relative_to(REPO)}) does not use, so Prefect "
                f"would drop it silently; declare and reference it there or remove it from the deployment"
            )
    return problems


def render(
    template: dict[str, Any],
    job_variables: dict[str, Any],
    worker_type: str = "kubernetes",
    *,
    flow_name: str = "evaluate-engine",
    deployment_name: str = "evaluate-vllm",
    strict: bool = True,
):
    """The job configuration a worker of this type builds for a flow run of a deployment with these variables.

    Prefect's own code does the work: the configuration class's from_template_and_values (defaults, env merge,
    templating) and prepare_for_flow_run (for Kubernetes: env into the container, labels, command, image).
    With strict=True a variable that would be dropped raises TemplateProblem instead.
    """
    from prefect.client.orchestration import PrefectClient, get_client
    from prefect.client.schemas.objects import Flow, FlowRun
    from prefect.settings import PREFECT_API_URL
    from prefect.client.schemas.responses import DeploymentResponse

    config_cls = job_configuration_class(worker_type)
    if strict:
        dropped = dropped_job_variables(template, job_variables, config_cls)
        if dropped:
            raise TemplateProblem(
                f"job variables {dropped} are not used by this template, so Prefect would drop them silently; "
                f"declare and reference them in the template or remove them"
            )

    flow = Flow(id=uuid.uuid4(), name=flow_name)
    deployment = DeploymentResponse(id=uuid.uuid4(), name=deployment_name, flow_id=flow.id, job_variables=job_variables)
    flow_run = FlowRun(id=uuid.uuid4(), name="rendered-run", flow_id=flow.id, deployment_id=deployment.id)

    async def build():
        # The API is asked only for {{ prefect.blocks.* }} / {{ prefect.variables.* }} placeholders: with no server
        # configured, the client points at a closed port so such a template fails loudly instead of starting a
        # temporary server just to render.
        client = get_client() if PREFECT_API_URL.value() else PrefectClient(api="http://127.0.0.1:9/api")
        async with client:
            return await config_cls.from_template_and_values(template, job_variables, client=client)

    configuration = asyncio.run(build())
    configuration.prepare_for_flow_run(flow_run=flow_run, deployment=deployment, flow=flow)
    return configuration


def _parse_var(text: str) -> tuple[str, Any]:
    name, sep, raw = text.partition("=")
    if not sep:
        raise TemplateProblem(f"--var {text!r} needs the form NAME=VALUE (VALUE as JSON or a plain string)")
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        return name, raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python infra/pool_templates.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="check the GPU pool templates and the deployments' job variables")
    check.add_argument("--prefect-file", default=str(REPO / "deployments/prefect.yaml"))
    show = sub.add_parser("render", help="print the Kubernetes Job manifest a pool's worker would create")
    show.add_argument("pool", choices=sorted(KUBERNETES_POOLS))
    show.add_argument("--var", action="append", default=[], help="job variable NAME=VALUE (repeatable)")
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            problems = []
            for pool, (worker_type, path) in KUBERNETES_POOLS.items():
                template, config_cls = load_template(path), job_configuration_class(worker_type)
                where = str(path.relative_to(REPO))
                problems += check_template(template, config_cls, where)
                problems += check_run_time_variables(template, config_cls, where)
            problems += check_deployments(args.prefect_file)
            for problem in problems:
                print(problem, file=sys.stderr)
            if not problems:
                print(f"ok: {', '.join(KUBERNETES_POOLS)} templates and {args.prefect_file} use every job variable")
            return 1 if problems else 0
        worker_type, path = KUBERNETES_POOLS[args.pool]
        configuration = render(load_template(path), dict(_parse_var(v) for v in args.var), worker_type)
        print(yaml.safe_dump(configuration.job_manifest, sort_keys=False))
        return 0
    except TemplateProblem as exc:
        print(f"pool_templates: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
