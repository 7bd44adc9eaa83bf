#!/usr/bin/env bash
# Stop what `make up` started: each process group gets SIGTERM, then SIGKILL after 10 s.
set -uo pipefail
cd "$(dirname "$0")/.."
RUN_DIR="${AIRFLOW_HOME:-$PWD/.airflow}/run"
for pidfile in "$RUN_DIR"/*.pid; do
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    for _ in $(seq 1 10); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    echo "stopped $(basename "$pidfile" .pid) (pid $pid)"
  fi
  rm -f "$pidfile"
done
