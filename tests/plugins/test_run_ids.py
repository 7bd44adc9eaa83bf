"""Run ids that fit Airflow's task log path: the trigger pattern `make up` sets refuses longer ones at trigger."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from stagewise.airflow.run_ids import max_run_id_length, run_id_pattern

REPO_ROOT = Path(__file__).resolve().parents[2]


def _default_template() -> str:
    from airflow.configuration import conf

    return conf.get_default_value("logging", "log_filename_template")


def test_the_limit_comes_from_the_log_filename_template():
    """Airflow's default template puts the run id in a segment of its own after 'run_id=': 255 - 7 bytes; another
    template gives another limit; one without the run id leaves Airflow's own 250."""
    assert max_run_id_length(_default_template()) == 248
    assert max_run_id_length("{{ ti.dag_id }}/run-of-{{ ti.run_id }}/{{ ti.task_id }}.log") == 248
    assert max_run_id_length("{{ ti.dag_id }}/{{ ti.run_id }}__{{ ti.run_id }}.log") == 124  # (255 - 6) // 2
    assert max_run_id_length("{{ ti.dag_id }}/{{ ti.task_id }}.log") == 250


def test_the_longest_allowed_run_id_gets_its_log_folder_and_one_more_character_would_not(tmp_path):
    """What the limit is for: the folders of Airflow's own log path (its renderer, its default template) for a run
    id of the limit are made; one character more is 'File name too long', where a 250-character id failed every
    task before any of its code ran."""
    from airflow.utils.helpers import log_filename_template_renderer

    render = log_filename_template_renderer()

    class TaskInstance:
        dag_id, task_id, map_index, try_number = "ml_pipeline", "start_run", -1, 1

    longest = max_run_id_length()
    TaskInstance.run_id = "r" * longest
    path = tmp_path / render(ti=TaskInstance)
    path.parent.mkdir(parents=True)
    path.write_text("log")
    TaskInstance.run_id = "r" * (longest + 1)
    with pytest.raises(OSError, match="File name too long"):
        (tmp_path / render(ti=TaskInstance)).parent.mkdir(parents=True)


def test_make_up_sets_the_pattern_and_airflow_refuses_a_longer_run_id_at_trigger(monkeypatch):
    """scripts/airflow_env.sh sets allowed_run_id_pattern to what run_id_pattern() computes from Airflow's default
    template; with it, Airflow's own run id check (REST, UI and CLI triggers) refuses one character more."""
    from airflow.models.dagrun import DagRun

    shown = subprocess.run(["bash", "-c", "unset AIRFLOW__SCHEDULER__ALLOWED_RUN_ID_PATTERN; . scripts/airflow_env.sh; "
                            "echo \"$AIRFLOW__SCHEDULER__ALLOWED_RUN_ID_PATTERN\""], cwd=REPO_ROOT, check=True,
                           capture_output=True, text=True).stdout.strip()
    assert shown == run_id_pattern(_default_template())
    monkeypatch.setenv("AIRFLOW__SCHEDULER__ALLOWED_RUN_ID_PATTERN", shown)
    run = DagRun()
    assert run.validate_run_id("run_id", "manual:" + "x" * 241) == "manual:" + "x" * 241
    with pytest.raises(ValueError, match=re.escape("does not match regex pattern '^[A-Za-z0-9_.~:+-]{1,248}$'")):
        run.validate_run_id("run_id", "y" * 249)


def test_docker_compose_sets_the_same_pattern():
    """The compose deployment (PostgreSQL, Celery) writes the same log path, so it takes the same bound."""
    import yaml

    environment = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())["x-airflow"]["environment"]
    assert environment["AIRFLOW__SCHEDULER__ALLOWED_RUN_ID_PATTERN"].replace("$$", "$") == run_id_pattern(_default_template())
