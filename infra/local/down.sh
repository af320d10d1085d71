#!/usr/bin/env bash
# Stop everything infra/local/up.sh started (workers and their flow runs, the Prefect server, SeaweedFS, Postgres)
# and leave nothing running; data stays in DRAFTLINE_INFRA_DIR for the next up.sh (add --purge to delete it).
# No errexit: a cleanup goes on past any one failure, and says at the end what (if anything) is left.
set -u
STATE="${DRAFTLINE_INFRA_DIR:-/var/tmp/draftline-infra}"
purge=false
[ "${1:-}" = "--purge" ] && purge=true
if [ ! -d "$STATE" ]; then
  echo "down.sh: nothing to stop ($STATE does not exist)"
  exit 0
fi
STATE="$(cd "$STATE" && pwd)"
STACK_ID="$(sed -n 's/^STACK_ID=//p' "$STATE/secrets.env" 2>/dev/null || true)"

# The processes of this stack: up.sh gave each one DRAFTLINE_STACK_ID in its environment (inherited by flow runs,
# vLLM servers and weed, which all start sessions of their own), plus every process in the session of such a
# process (vLLM's engine renames itself, which blanks its environment). Nothing else is touched: not our own
# session, nor any process without the marker outside the stack's sessions.
session_of() { local stat; stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1; set -- ${stat##*) }; echo "${4:?}"; }
own_session="$(session_of $$)"
stack_pids() {
  [ -n "$STACK_ID" ] || return 0
  local dir pid sid sessions=" "
  for dir in /proc/[0-9]*; do
    pid="${dir#/proc/}"
    [ "$pid" = "$$" ] && continue
    if grep -qzxF "DRAFTLINE_STACK_ID=$STACK_ID" "$dir/environ" 2>/dev/null; then
      echo "$pid"
      sid="$(session_of "$pid")" && [ "$sid" != "$own_session" ] && sessions+="$sid "
    fi
  done
  [ "$sessions" = " " ] && return 0
  for dir in /proc/[0-9]*; do
    pid="${dir#/proc/}"
    sid="$(session_of "$pid")" || continue
    case "$sessions" in *" $sid "*) grep -qzxF "DRAFTLINE_STACK_ID=$STACK_ID" "$dir/environ" 2>/dev/null || echo "$pid" ;; esac
  done
}
stop_group() {  # stop_group NAME: SIGTERM to the process group up.sh started (pid == pgid), wait, then SIGKILL
  local pidfile="$STATE/run/$1.pid" pid i
  [ -f "$pidfile" ] || return 0
  pid="$(cat "$pidfile")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 ${2:-20}); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

# Workers first (no new flow runs start), then the server, then the stores it and the flow runs used.
for pidfile in "$STATE"/run/worker-*.pid; do
  [ -e "$pidfile" ] || continue
  name="$(basename "$pidfile" .pid)"
  stop_group "$name" 20
done
stop_group prefect-server 20
stop_group s3 20   # run_s3.py stops weed on SIGTERM (keeping its data)

PG_BIN="${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)}"
[ -n "$PG_BIN" ] && [ -x "$PG_BIN/pg_ctl" ] || PG_BIN="$(dirname "$(command -v pg_ctl 2>/dev/null || echo /missing/pg_ctl)")"
if [ -f "$STATE/postgres/postmaster.pid" ] && [ -x "$PG_BIN/pg_ctl" ]; then
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$STATE/postgres" -m fast -w -t 30 stop >/dev/null 2>&1 || true
  else
    "$PG_BIN/pg_ctl" -D "$STATE/postgres" -m fast -w -t 30 stop >/dev/null 2>&1 || true
  fi
fi

# Whatever is left (a flow run's engine server, a process that ignored SIGTERM) is ended by its id.
for attempt in $(seq 1 15); do
  left="$(stack_pids)"
  [ -z "$left" ] && break
  signal=TERM
  [ "$attempt" -gt 10 ] && signal=KILL  # the engine guard needs up to 10 s to end its group
  for pid in $left; do kill -s "$signal" "$pid" 2>/dev/null || true; done
  sleep 1
done
left="$(stack_pids)"
if [ -n "$left" ]; then
  echo "down.sh: these processes of the stack are still running: $left; see ps -o pid,args -p ${left//$'\n'/,}" >&2
  exit 1
fi
rm -f "$STATE"/run/*.pid "$STATE/run/s3.ready"
if $purge; then
  rm -rf "$STATE"
  echo "draftline local team stack stopped; nothing is running and $STATE is deleted"
else
  echo "draftline local team stack stopped; nothing is running (data kept in $STATE; --purge deletes it)"
fi
