#!/usr/bin/env bash
# Start a local Airflow for a person: api-server (UI), scheduler, dag-processor and the task-log server,
# every one listening on 127.0.0.1 only.
# Usage: make up   (stop with: make down). Logs and pid files live in .airflow/; each component's log rotates at
# 10 MiB keeping 4 older files (STAGEWISE_SERVICE_LOG_MAX_MB, STAGEWISE_SERVICE_LOG_BACKUPS change that).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/airflow_env.sh
mkdir -p "$AIRFLOW_HOME/run" "$AIRFLOW_HOME/logs"
# Each component's output goes through a size-rotated writer (stagewise.airflow.service_log): <name>.log up to 10 MiB,
# then <name>.log.1 .. <name>.log.4, the oldest dropped: at most 50 MiB a component, 200 MiB for the four. The writer
# is in the component's process group, so make down stops both; it keeps the lines written until the pipe closes.
LOG_MAX_BYTES=$(( ${STAGEWISE_SERVICE_LOG_MAX_MB:-10} * 1024 * 1024 ))
LOG_BACKUPS="${STAGEWISE_SERVICE_LOG_BACKUPS:-4}"
start() {
  local name=$1; shift
  local pidfile="$AIRFLOW_HOME/run/$name.pid" log="$AIRFLOW_HOME/logs/$name.log"
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "$name already running (pid $(cat "$pidfile"))"; return
  fi
  setsid nohup bash -c 'log=$1 max=$2 keep=$3; shift 3
    "$@" 2>&1 < /dev/null | exec python -m stagewise.airflow.service_log "$log" --max-bytes "$max" --backups "$keep"' \
    service-log "$log" "$LOG_MAX_BYTES" "$LOG_BACKUPS" "$@" > /dev/null 2>&1 < /dev/null &
  echo $! > "$pidfile"
  echo "started $name (pid $!, log .airflow/logs/$name.log, rotated at $(( LOG_MAX_BYTES / 1024 / 1024 )) MiB)"
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
