"""A team's own task callback, as a config names it (airflow.on_failure_callback: tests.plugins.team_callbacks:page)."""

CALLED: list[str] = []


def page(context) -> None:
    CALLED.append(context["ti"].task_id)
