# Source me: a repo-local Airflow home on the embedded default (SQLite, LocalExecutor, local files).
# Usage: . scripts/airflow_env.sh   (variables already set in the environment win)
STAGEWISE_HOME="${STAGEWISE_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)}"
export STAGEWISE_HOME
# The venv has this project installed editable (make venv), so no PYTHONPATH: the package stagewise imports as is.
export PATH="$STAGEWISE_HOME/.venv/bin:$PATH"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$STAGEWISE_HOME/.airflow}"
export AIRFLOW__CORE__DAGS_FOLDER="${AIRFLOW__CORE__DAGS_FOLDER:-$STAGEWISE_HOME/dags}"
# Airflow's own default, not the checkout's plugins/: the UI plugin comes from the package's entry point, and a plugins
# folder holding stagewise_airflow/ needs a glob .airflowignore, which Airflow 3.3 compiles with pathspec's deprecated
# GitWildMatchPattern: a DeprecationWarning in every task log.
export AIRFLOW__CORE__PLUGINS_FOLDER="${AIRFLOW__CORE__PLUGINS_FOLDER:-$AIRFLOW_HOME/plugins}"
export AIRFLOW__CORE__LOAD_EXAMPLES="${AIRFLOW__CORE__LOAD_EXAMPLES:-False}"
export AIRFLOW__CORE__EXECUTOR="${AIRFLOW__CORE__EXECUTOR:-LocalExecutor}"
export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-sqlite:///$AIRFLOW_HOME/airflow.db}"
export AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="${AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION:-True}"
export AIRFLOW__API__HOST="${AIRFLOW__API__HOST:-127.0.0.1}"
export AIRFLOW__API__PORT="${AIRFLOW__API__PORT:-8080}"
export AIRFLOW__API__BASE_URL="${AIRFLOW__API__BASE_URL:-http://127.0.0.1:$AIRFLOW__API__PORT}"
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="${AIRFLOW__CORE__EXECUTION_API_SERVER_URL:-$AIRFLOW__API__BASE_URL/execution/}"
export AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT="${AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT:-8793}"
# One machine: tasks record 127.0.0.1 as their host, so the UI reads running logs from the loopback log server.
export AIRFLOW__CORE__HOSTNAME_CALLABLE="${AIRFLOW__CORE__HOSTNAME_CALLABLE:-stagewise.airflow.log_server.loopback_hostname}"
# SQLite takes one writer at a time: each connection waits up to 60 s for the lock, not Python's 5 s (a burst of
# triggers killed the scheduler); the Stagewise plugin queues the api-server's writes (stagewise.airflow.sqlite).
case "$AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" in
  sqlite:*)
    export AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS:-stagewise.airflow.sqlite.CONNECT_ARGS}"
    export AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC:-stagewise.airflow.sqlite.CONNECT_ARGS}";;
esac
# A running task rides out an api-server away for a few minutes (a restart, an upgrade): each execution-API call is
# tried 10 times, up to 60 s apart, and 6 heartbeats must fail in a row before the task is given up (Airflow's
# defaults, 5 tries up to 90 s apart and 3 heartbeats, gave up on a task after about 1 to 2 minutes).
export AIRFLOW__WORKERS__EXECUTION_API_RETRIES="${AIRFLOW__WORKERS__EXECUTION_API_RETRIES:-10}"
export AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MAX="${AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MAX:-60}"
export AIRFLOW__WORKERS__MAX_FAILED_HEARTBEATS="${AIRFLOW__WORKERS__MAX_FAILED_HEARTBEATS:-6}"
# A run id longer than Airflow's task log path takes (run_id=<id>/: 255 bytes) is refused at trigger with HTTP 400:
# `python -m stagewise.airflow.run_ids` prints this pattern for the deployment's [logging] log_filename_template.
_stagewise_run_ids='^[A-Za-z0-9_.~:+-]{1,248}$'
export AIRFLOW__SCHEDULER__ALLOWED_RUN_ID_PATTERN="${AIRFLOW__SCHEDULER__ALLOWED_RUN_ID_PATTERN:-$_stagewise_run_ids}"
unset _stagewise_run_ids
mkdir -p "$AIRFLOW_HOME"
# The SQLite DB and the generated admin password are secrets: create them empty and private (0600) before
# Airflow does (it keeps an existing file's mode), and make existing ones private too.
for _stagewise_secret in "${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE:-$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated}" \
    "$(case "$AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" in sqlite:///*) echo "${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN#sqlite:///}";; esac)"; do
  [ -n "$_stagewise_secret" ] || continue
  [ -e "$_stagewise_secret" ] || (umask 077 && : > "$_stagewise_secret") 2>/dev/null || true
  chmod 600 "$_stagewise_secret" 2>/dev/null || true
done
unset _stagewise_secret
