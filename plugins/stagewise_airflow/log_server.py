"""Airflow's task-log server on 127.0.0.1 only, for a single-machine Airflow (``make up``).

Run: ``python -m stagewise.airflow.log_server`` (port: ``[logging] worker_log_server_port``), with
``[core] hostname_callable = stagewise.airflow.log_server.loopback_hostname``.

While a task runs, the api-server reads its log from ``http://<ti.hostname>:<worker_log_server_port>``.
The scheduler's built-in server (and ``airflow standalone``'s) binds every interface and has no host
setting, so ``make up`` runs the scheduler with ``--skip-serve-logs`` and this module serves the same
Airflow app on loopback; tasks record 127.0.0.1 as their hostname so the api-server looks there.
"""

from __future__ import annotations

LOOPBACK = "127.0.0.1"


def loopback_hostname() -> str:
    """``[core] hostname_callable`` for one machine: tasks' logs are served (and read) on 127.0.0.1."""
    return LOOPBACK


def main(argv: list[str] | None = None) -> None:
    import argparse

    argparse.ArgumentParser(description=(
        "Serve Airflow's task logs on 127.0.0.1 at [logging] worker_log_server_port, for a single-machine Airflow "
        "whose [core] hostname_callable is stagewise.airflow.log_server.loopback_hostname.")).parse_args(argv)
    import uvicorn
    from airflow.configuration import conf

    port = conf.getint("logging", "worker_log_server_port")
    # log_config=None keeps Airflow's logging setup; access logs of internal log fetches are noise.
    uvicorn.run("airflow.utils.serve_logs.log_server:get_app", factory=True, host=LOOPBACK, port=port,
                log_level=conf.get("logging", "uvicorn_logging_level", fallback="info").lower(),
                log_config=None, access_log=False)


if __name__ == "__main__":
    main()
