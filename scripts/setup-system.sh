#!/usr/bin/env bash
# Debian packages the test suite needs: Chromium (Prefect UI screenshot test) and PostgreSQL (infra/local), and the
# tcmalloc that vLLM's CPU backend asks to preload (draftline/engines/cpu_preload.py).
# Installs only what is missing; needs root (as on CI) or passwordless sudo.
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || need+=(libtcmalloc-minimal4)
[ ${#need[@]} -eq 0 ] && exit 0
echo "installing Debian packages: ${need[*]}" >&2
SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The Debian postgresql package starts a cluster service; the tests run their own clusters.
$SUDO service postgresql stop >/dev/null 2>&1 || true
