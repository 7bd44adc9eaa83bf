"""What a stage cost on a cluster: each attempt's figures recorded beside the stage, summed into its result and shown.

A Slurm stage's attempt (one allocation) ends with its cost (stagewise.airflow.backends.slurm.cost: elapsed_s,
cpu_time_s, nodes, gpu_hours and where they came from: sacct, scontrol or the job-completion log). Every attempt,
failed ones too, is written to ``<run>/train/<stage>/slurm/cost/attempt-<n>.json`` by the task that waited for it, so
the attempt that succeeds sums them all (:func:`gathered`) into its result's ``cost``: report.json's training entry and
stage timing, the report's stage table, the ``stagewise.report`` text and the run view carry it.
"""

from __future__ import annotations

import logging
from typing import Any

from stagewise.core import storage

log = logging.getLogger("stagewise.report")

# Summed over a stage's attempts; ``nodes`` is the last attempt's (a retry may run on fewer).
SUMMED = ("elapsed_s", "cpu_time_s", "gpu_hours")


def attempt_uri(out: str, stage: str, attempt: int) -> str:
    """Where attempt ``attempt`` of ``stage`` of the run under ``out`` keeps its cost."""
    return storage.join(storage.stage_prefix(out, stage), "slurm", "cost", f"attempt-{int(attempt)}.json")


def record(out: str, stage: str, attempt: int, cost: dict[str, Any], job_id: str | None = None,
           state: str | None = None) -> dict[str, Any]:
    """Write one attempt's cost (with its Slurm job id and end state); returns what was written."""
    entry = {"attempt": int(attempt), **cost}
    if job_id is not None:
        entry["job_id"] = str(job_id)
    if state is not None:
        entry["state"] = state
    storage.write_json(attempt_uri(out, stage, attempt), entry)
    return entry


def attempts(out: str, stage: str, upto: int) -> list[dict[str, Any]]:
    """The recorded costs of attempts 1..``upto`` of the stage, those that recorded one (a try that died before its
    job ended has none)."""
    found = []
    for attempt in range(1, int(upto) + 1):
        uri = attempt_uri(out, stage, attempt)
        try:
            found.append(storage.read_json(uri))
        except FileNotFoundError:
            continue
        except Exception as exc:  # noqa: BLE001 - the cost is a view of the stage, never a reason to fail it
            log.warning("stage %s: attempt %d's cost at %s is unreadable (%s); left out", stage, attempt, uri, exc)
    return found


def summary(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The stage's cost from its attempts' entries: each attempt, the sums of SUMMED, the last attempt's node count
    and source; None without any entry."""
    if not entries:
        return None
    total: dict[str, Any] = {}
    for key in SUMMED:
        values = [entry.get(key) for entry in entries if entry.get(key) is not None]
        total[key] = round(sum(float(value) for value in values), 6) if values else None
    last = entries[-1]
    return {**total, "nodes": last.get("nodes"), "source": last.get("source"), "attempts": list(entries)}


def gathered(out: str, stage: str, upto: int) -> dict[str, Any] | None:
    """The stage's cost over attempts 1..``upto`` (:func:`summary` of :func:`attempts`)."""
    return summary(attempts(out, stage, upto))


def samples_per_s(history: list[dict[str, Any]] | None) -> float | None:
    """A stage's throughput: the mean of its epochs' samples/s (stagewise.train's history), None without any."""
    values = [float(entry["samples_per_s"]) for entry in history or [] if entry.get("samples_per_s") is not None]
    return round(sum(values) / len(values), 3) if values else None


def _figure(value: Any, digits: int) -> str:
    return "?" if value is None else f"{float(value):.{digits}f}"


def text(cost: dict[str, Any] | None) -> str:
    """One line of a stage's cost: ``2 nodes, 41.0 s elapsed, 164.0 CPU-s, 0.000 GPU-h (2 attempts, scontrol)``."""
    if not cost:
        return ""
    count = len(cost.get("attempts") or [])
    nodes = cost.get("nodes")
    where = ", ".join(part for part in (f"{count} attempt{'s' if count != 1 else ''}" if count else "",
                                        str(cost.get("source") or "")) if part)
    return (f"{nodes if nodes is not None else '?'} node{'s' if nodes != 1 else ''}, "
            f"{_figure(cost.get('elapsed_s'), 1)} s elapsed, {_figure(cost.get('cpu_time_s'), 1)} CPU-s, "
            f"{_figure(cost.get('gpu_hours'), 3)} GPU-h" + (f" ({where})" if where else ""))
