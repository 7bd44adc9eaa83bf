"""A data set tied to a run's interval: ``dataset.uri`` (or ``inference.input_uri``) may name the run's
``{data_interval_start}``, ``{data_interval_end}`` or ``{logical_date}``, each with an optional strftime format
(``raw/events/{data_interval_start:%Y/%m/%d/%H}``), filled once by the run's first task, so scheduled, catch-up and
backfilled runs each read their own data. Without a format a time reads ``2026-11-28T03:00:00`` (UTC).
"""

from __future__ import annotations

import datetime as dt
import string
from collections.abc import Mapping

INTERVAL_FIELDS = ("data_interval_start", "data_interval_end", "logical_date")
DEFAULT_FORMAT = "%Y-%m-%dT%H:%M:%S"


def fields_in(template: str, key: str) -> list[str]:
    """The interval fields ``template`` names; ValueError naming ``key`` for any other placeholder or a broken brace."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"{key}: {exc} in {template!r} (write a literal brace as {{{{ or }}}})") from None
    names = [name for _, name, _, _ in parsed if name is not None]
    if unknown := [name for name in names if name not in INTERVAL_FIELDS]:
        raise ValueError(f"{key}: unknown placeholder(s) {unknown} in {template!r}; a run's interval is named by "
                         f"{', '.join('{' + field + '}' for field in INTERVAL_FIELDS)}")
    return names


def static_prefix(template: str) -> str:
    """The folder of ``template`` before its first placeholder (the template itself when it names none)."""
    if "{" not in template:
        return template
    return template[: template.index("{")].rsplit("/", 1)[0] or "."


class _Moment:
    """A UTC time that formats by strftime, with DEFAULT_FORMAT when the placeholder gives none."""

    def __init__(self, value: dt.datetime) -> None:
        self.value = value.astimezone(dt.UTC) if value.tzinfo else value

    def __format__(self, spec: str) -> str:
        return self.value.strftime(spec or DEFAULT_FORMAT)


def fill(template: str, key: str, values: Mapping[str, dt.datetime | None]) -> str:
    """``template`` with the run's interval filled in; ValueError naming ``key`` when the run has no such time (a manual
    run of an unscheduled DAG has no data interval of its own)."""
    names = fields_in(template, key)
    if missing := sorted({name for name in names if values.get(name) is None}):
        raise ValueError(f"{key} is {template!r}, but this run has no {', '.join(missing)}: trigger it with a logical "
                         f"date (the retrain DAG's schedule, a backfill, or `airflow dags test <dag> <date>`), or give "
                         f"the input_uri Param a plain path")
    return template.format(**{name: _Moment(values[name]) for name in set(names)})  # type: ignore[arg-type]


def interval_record(values: Mapping[str, dt.datetime | None]) -> dict[str, str | None]:
    """The interval as the report and the card name it (ISO 8601, UTC)."""
    return {"start": _iso(values.get("data_interval_start")), "end": _iso(values.get("data_interval_end")),
            "logical_date": _iso(values.get("logical_date"))}


def _iso(value: dt.datetime | None) -> str | None:
    return None if value is None else (value.astimezone(dt.UTC) if value.tzinfo else value).isoformat()
