#!/usr/bin/env bash
# Start a local Airflow for a person: api-server (UI), scheduler, dag-processor and the task-log server,
# every one listening on 127.0.0.1 only.
# Usage: make up   (stop with: make down). Logs and pid files live in .airflow/.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/airflow_env.sh
mkdir -p "$AIRFLOW_HOME/run" "$AIRFLOW_HOME/logs"
start() {
  local name=$1; shift
  local pidfile="$AIRFLOW_HOME/run/$name.pid"
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "$name already running (pid $(cat "$pidfile"))"; return
  fi
  setsid nohup "$@" > "$AIRFLOW_HOME/logs/$name.log" 2>&1 < /dev/null &
  echo $! > "$pidfile"
  echo "started $name (pid $!, log .airflow/logs/$name.log)"
}
start api-server airflow api-server -H 127.0.0.1 -p "$AIRFLOW__API__PORT"
start scheduler airflow scheduler --skip-serve-logs
start dag-processor airflow dag-processor
# The scheduler's own log server binds every interface; this serves running tasks' logs on 127.0.0.1.
start log-server python -m stagewise.airflow.log_server
for _ in $(seq 1 90); do
  if python -c "import urllib.request,sys; urllib.request.urlopen('$AIRFLOW__API__BASE_URL/api/v2/monitor/health', timeout=2)" 2>/dev/null; then
    echo "Airflow UI: $AIRFLOW__API__BASE_URL  (user admin; password in .airflow/simple_auth_manager_passwords.json.generated)"
    exit 0
  fi
  sleep 1
done
echo "the api-server did not answer within 90 s; see .airflow/logs/api-server.log" >&2
exit 1
