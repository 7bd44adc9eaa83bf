"""What Slurm says about a job, parsed (pure): ``scontrol show job -o``, ``sacct -P`` and the job-completion log's
lines as one :class:`SlurmJob` record each, and what an allocation cost (:func:`cost`). The backend's commands and its
wait are in :mod:`stagewise.airflow.backends.slurm`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# Job states after which the job never runs again (sacct writes "CANCELLED by <uid>": the first word counts).
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "TIMEOUT", "OUT_OF_MEMORY",
            "DEADLINE", "REVOKED", "SPECIAL_EXIT")
_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][\w:/]*)=")


@dataclass(frozen=True)
class SlurmJob:
    """One Slurm job as its record shows it (``scontrol show job``, ``sacct`` or the job-completion log)."""

    job_id: str
    state: str
    """JobState's first word: PENDING, RUNNING, COMPLETED, FAILED, NODE_FAIL, ..."""
    reason: str = ""
    """Why it pends or ended (Reason), '' for None."""
    exit_code: int | None = None
    """The batch script's exit code (ExitCode's first half); None before it ended."""
    signal: int = 0
    """The signal that ended it (ExitCode's second half)."""
    nodes: int = 0
    """Nodes allocated (NumNodes)."""
    node_list: str = ""
    """Their list as Slurm writes it, e.g. n[1-2]."""
    elapsed_s: float = 0.0
    """Seconds the job ran (its last run after a requeue)."""
    cpus: int = 0
    """CPUs allocated over all its nodes."""
    gpus: int = 0
    """GPUs allocated over all its nodes (gres/gpu in its TRES)."""
    restarts: int = 0
    """Times it was requeued."""
    source: str = "scontrol"
    """Where the record came from: scontrol, sacct or jobcomp."""
    total_cpu_s: float | None = None
    """CPU seconds its processes used (sacct's TotalCPU); None without accounting."""
    fields: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    """Every field of the record, raw."""

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL


def _duration_s(text: str) -> float:
    """Slurm's [days-]hours:minutes:seconds (or minutes:seconds) as seconds."""
    days, _, clock = text.rpartition("-")
    parts = [float(part) for part in clock.split(":")]
    seconds = sum(value * 60 ** index for index, value in enumerate(reversed(parts)))
    return seconds + (int(days) * 86400 if days else 0)


def _tres(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",") if "=" in item)


def parse_fields(line: str) -> dict[str, str]:
    """``Key=value Key=value ...`` (scontrol -o, the job-completion log) as a dict; a value may hold spaces."""
    matches = list(_KEY.finditer(line.strip()))
    text = line.strip()
    return {match.group(1): text[match.end():matches[index + 1].start() if index + 1 < len(matches) else len(text)].strip()
            for index, match in enumerate(matches)}


def _exit(text: str) -> tuple[int | None, int]:
    code, _, signal = (text or "").partition(":")
    return (int(code) if code.isdigit() else None), (int(signal) if signal.isdigit() else 0)


def _gpus(tres: dict[str, str]) -> int:
    return sum(int(value) for key, value in tres.items() if key.split(":")[0] == "gres/gpu" and value.isdigit())


def parse_scontrol(line: str) -> SlurmJob:
    """One job of ``scontrol show job -o``."""
    raw = parse_fields(line)
    code, signal = _exit(raw.get("ExitCode", ""))
    tres = _tres(raw.get("TRES", ""))
    reason = raw.get("Reason", "None")
    return SlurmJob(job_id=raw.get("JobId", ""), state=raw.get("JobState", "UNKNOWN").split()[0],
                    reason="" if reason == "None" else reason, exit_code=code, signal=signal,
                    nodes=int(raw.get("NumNodes", "0").split("-")[0] or 0), node_list=raw.get("NodeList", "") or "",
                    elapsed_s=_duration_s(raw.get("RunTime", "0:0")), cpus=int(raw.get("NumCPUs", "0").split("-")[0] or 0),
                    gpus=_gpus(tres), restarts=int(raw.get("Restarts", "0") or 0), source="scontrol", fields=raw)


SACCT_FIELDS = ("JobID", "State", "ExitCode", "NNodes", "NodeList", "ElapsedRaw", "AllocCPUS", "AllocTRES", "Reason",
                "TotalCPU", "CPUTimeRAW")


def parse_sacct(lines: Sequence[str]) -> SlurmJob | None:
    """``sacct -X -D -P -n --format=<SACCT_FIELDS>``: one line per run of the job (a requeue adds one); the last counts."""
    rows = [dict(zip(SACCT_FIELDS, line.split("|"), strict=False)) for line in lines if line.strip()]
    if not rows:
        return None
    row = rows[-1]
    code, signal = _exit(row.get("ExitCode", ""))
    total = row.get("TotalCPU", "")
    return SlurmJob(job_id=row["JobID"], state=(row.get("State") or "UNKNOWN").split()[0],
                    reason="" if row.get("Reason") in ("None", "", None) else row["Reason"], exit_code=code, signal=signal,
                    nodes=int(row.get("NNodes") or 0), node_list="" if row.get("NodeList") == "None assigned" else row.get("NodeList", ""),
                    elapsed_s=float(row.get("ElapsedRaw") or 0), cpus=int(row.get("AllocCPUS") or 0),
                    gpus=_gpus(_tres(row.get("AllocTRES", ""))), restarts=len(rows) - 1, source="sacct",
                    total_cpu_s=_duration_s(total) if total else None, fields=row)


def parse_jobcomp(line: str) -> SlurmJob:
    """One line of the job-completion log (JobCompType=jobcomp/filetxt), written as each run of a job ends."""
    raw = parse_fields(line)
    code, signal = _exit(raw.get("ExitCode", ""))
    elapsed = 0.0
    if raw.get("StartTime", "").startswith("20") and raw.get("EndTime", "").startswith("20"):
        from datetime import datetime

        elapsed = (datetime.fromisoformat(raw["EndTime"]) - datetime.fromisoformat(raw["StartTime"])).total_seconds()
    return SlurmJob(job_id=raw.get("JobId", ""), state=raw.get("JobState", "UNKNOWN").split()[0], exit_code=code,
                    signal=signal, nodes=int(raw.get("NodeCnt") or 0), node_list=raw.get("NodeList", ""), elapsed_s=elapsed,
                    cpus=int(raw.get("ProcCnt") or 0), gpus=_gpus(_tres(raw.get("Tres", ""))), source="jobcomp", fields=raw)


def cost(record: SlurmJob, accounting: SlurmJob | None = None) -> dict[str, Any]:
    """What the allocation cost: elapsed and CPU time (allocated CPUs x elapsed, as sacct's CPUTime), nodes and
    GPU-hours, from ``accounting`` (sacct) where the cluster keeps it, else from ``record`` (scontrol or the
    job-completion log); with accounting also ``total_cpu_s``, the CPU its processes used."""
    chosen = accounting or record
    result = {"job_id": chosen.job_id, "elapsed_s": round(chosen.elapsed_s, 3),
              "cpu_time_s": round(chosen.cpus * chosen.elapsed_s, 3), "nodes": chosen.nodes,
              "gpu_hours": round(chosen.gpus * chosen.elapsed_s / 3600, 6), "restarts": max(record.restarts, chosen.restarts),
              "source": chosen.source}
    if accounting is not None:
        if accounting.fields.get("CPUTimeRAW", "").isdigit():
            result["cpu_time_s"] = float(accounting.fields["CPUTimeRAW"])
        if accounting.total_cpu_s is not None:
            result["total_cpu_s"] = round(accounting.total_cpu_s, 3)
    return result
