"""Run ids that fit Airflow's own task log path: the trigger pattern that refuses longer ones.

Run: ``python -m stagewise.airflow.run_ids`` prints the ``[scheduler] allowed_run_id_pattern`` for this deployment's
``[logging] log_filename_template`` (``make up`` and docker/compose.yaml set it).

Airflow writes each task attempt's log under ``run_id=<run id>/``, one path segment, and a file system takes at
most 255 bytes a segment: a longer run id (Airflow admits 250 characters) is accepted at trigger, then every task
of the run fails opening its log (``File name too long``) before any of its code runs. Airflow checks a run id a
person gives against ``allowed_run_id_pattern`` when the run is created (REST, UI, CLI: HTTP 400 naming the pattern),
so bounding the pattern's length refuses such a run at trigger. Our own folders are cut anyway
(stagewise.core.storage.safe_name).
"""

from __future__ import annotations

import re

NAME_MAX = 255
"""Bytes of one path segment (Linux's NAME_MAX, most file systems' limit)."""

AIRFLOW_RUN_ID_MAX = 250
"""Characters of dag_run.run_id in Airflow's metadata DB."""

RUN_ID_CHARACTERS = "A-Za-z0-9_.~:+-"
"""The characters of Airflow's default allowed_run_id_pattern (one byte each)."""

_EXPRESSION = re.compile(r"\{\{.*?\}\}|\{%.*?%\}")


def max_run_id_length(template: str | None = None) -> int:
    """The longest run id whose log path segments stay within NAME_MAX bytes under ``template`` (default: this
    deployment's ``[logging] log_filename_template``)."""
    if template is None:
        from airflow.configuration import conf

        template = conf.get("logging", "log_filename_template")
    longest = AIRFLOW_RUN_ID_MAX
    for segment in template.split("/"):
        uses = len(re.findall(r"\{\{[^}]*\brun_id\b[^}]*\}\}", segment))
        if uses:
            literal = _EXPRESSION.sub("", segment)  # 'run_id=' of 'run_id={{ ti.run_id }}'
            longest = min(longest, (NAME_MAX - len(literal.encode())) // uses)
    return longest


def run_id_pattern(template: str | None = None) -> str:
    """``[scheduler] allowed_run_id_pattern``: Airflow's default characters, at most max_run_id_length of them."""
    return f"^[{RUN_ID_CHARACTERS}]{{1,{max_run_id_length(template)}}}$"


def main(argv: list[str] | None = None) -> None:
    import argparse

    argparse.ArgumentParser(description="Print the [scheduler] allowed_run_id_pattern for this deployment's [logging] "
                                        "log_filename_template.").parse_args(argv)
    print(run_id_pattern())


if __name__ == "__main__":
    main()
