#!/usr/bin/env bash
# Debian packages the test suite needs: Chromium (Prefect UI screenshot test) and PostgreSQL (infra/local), and the
# tcmalloc that vLLM's CPU backend asks to preload (draftline/engines/cpu_preload.py).
# Installs only what is missing; needs root (as on CI) or passwordless sudo.
# `setup-system.sh demo` (make demo) wants tcmalloc only, and goes on without it where it cannot install it.
set -euo pipefail
need=()
if [ "${1:-}" != demo ]; then
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
fi
ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || need+=(libtcmalloc-minimal4)
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
if [ "${1:-}" = demo ] && [ -n "$SUDO" ] && ! sudo -n true 2>/dev/null; then
  echo "libtcmalloc-minimal4 is not installed and this user cannot install it: vLLM on this CPU serves without the" \
       "tcmalloc preload its CPU guide asks for (apt-get install libtcmalloc-minimal4 as root adds it)" >&2
  exit 0
fi
echo "installing Debian packages: ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The Debian postgresql package starts a cluster service; the tests run their own clusters.
$SUDO service postgresql stop >/dev/null 2>&1 || true
