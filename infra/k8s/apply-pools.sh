#!/usr/bin/env bash
# Create or update the GPU work pools (gpu-vllm, gpu-sglang, gpu-train) on the Prefect server at $PREFECT_API_URL from the
# base job templates next to this script, after checking that no job variable would be silently dropped; and create
# the cpu pool, where a process worker in the draftline image (workers.yaml) runs the flows that compose and wait.
#   PREFECT_API_URL=https://prefect.example/api PREFECT_API_AUTH_STRING=user:password infra/k8s/apply-pools.sh [POOL...]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
PY="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
if [ -z "${PREFECT_API_URL:-}" ]; then
  echo "apply-pools.sh: PREFECT_API_URL is not set; export the team server's API URL (e.g. http://HOST:4200/api) first" >&2
  exit 2
fi
if [ -z "${PREFECT_API_AUTH_STRING:-}" ]; then
  echo "apply-pools.sh: PREFECT_API_AUTH_STRING is not set; export the team server's auth string (user:password) first" >&2
  exit 2
fi
# A variable that the template does not use would vanish without a word: refuse to apply such templates.
"$PY" "$repo/infra/pool_templates.py" check
pools=("$@")
[ ${#pools[@]} -gt 0 ] || pools=(cpu gpu-vllm gpu-sglang gpu-train)
for pool in "${pools[@]}"; do
  if [ "$pool" = cpu ]; then
    # Prefect's own process template: nothing to update once the pool exists. `prefect deploy` needs it to exist.
    if found=$("$PY" -m prefect work-pool inspect cpu --output json 2> /dev/null); then
      type=$(printf '%s' "$found" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["type"])')
      if [ "$type" != process ]; then
        echo "apply-pools.sh: work pool 'cpu' is of type '$type', but workers.yaml serves it with a process worker;" \
          "delete it (prefect work-pool delete cpu) and run this again" >&2
        exit 2
      fi
    else
      "$PY" -m prefect work-pool create cpu --type process
    fi
    continue
  fi
  template="$here/$pool.json"
  if [ ! -f "$template" ]; then
    echo "apply-pools.sh: no template $template for pool '$pool'; choose from: $(cd "$here" && ls *.json | sed 's/\.json$//' | tr '\n' ' ')" >&2
    exit 2
  fi
  # --overwrite updates an existing pool's template in place (its queues, workers and runs stay).
  "$PY" -m prefect work-pool create "$pool" --type kubernetes --base-job-template "$template" --overwrite
done
