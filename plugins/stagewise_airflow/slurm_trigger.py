"""Waiting for a Slurm job in Airflow's triggerer: :class:`SlurmJobTrigger` polls the job's state and fires when it ends.

A train stage of a profile with ``backend: slurm`` and ``slurm.deferrable`` (stagewise.airflow.operators.
SlurmStageOperator) submits its try's job and defers to this trigger: no worker slot is held while the job queues or
runs. Every ``poll_s`` the trigger reads the job's record (stagewise.airflow.backends.slurm.job_record, in a thread:
it runs Slurm's clients) and the new lines of its output file, and logs state changes, a wait in the queue past
``queue_wait_warn_s`` (with Slurm's reason, never as a failure) and the output: in Airflow 3 the triggerer writes a
trigger's log beside its task instance's (``<log>.trigger.<job>.log``), which the task's log view shows with the rest.
The event names the job, its end state and how far the output was logged; the task resumes there.

Cancelling: :meth:`SlurmJobTrigger.on_kill` (Airflow 3.3's hook for a user's mark-failed, mark-success or clear of the
deferred task) scancels the job. :meth:`cleanup` never does: the triggerer calls it on every exit, a restart or a
rolling deploy included, and the job must outlive those (the next triggerer picks the trigger up again). A trigger
timeout (the task's execution_timeout) calls cleanup alone; the task resumes in ``__fail__`` and the operator cancels
there (stagewise.airflow.operators.SlurmStageOperator.resume_execution).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

# Consecutive failed polls (the controller unreachable) before the trigger gives up and lets the task decide.
MAX_POLL_FAILURES = 30


def settings_from(values: dict[str, Any]) -> Any:
    """The profile's SlurmSettings again from the dict a trigger carries (trigger kwargs travel as JSON): validated
    when the config loaded, so built as they are."""
    from stagewise.definitions.config import SlurmSettings

    return SlurmSettings.model_construct(**{**SlurmSettings().model_dump(), **values})


def tail_from(path: str, offset: int) -> Any:
    """The backend's OutputTail of the job's output file, reading on from byte ``offset`` (a line's start)."""
    from stagewise.airflow.backends import slurm

    tail = slurm.OutputTail(path)
    tail.offset = int(offset)
    return tail


def line_offset(tail: Any) -> int:
    """Where the tail's next whole line starts (what it read, less the partial line it holds)."""
    return int(tail.offset) - len(tail.partial.encode("utf-8", errors="replace"))


class SlurmJobTrigger(BaseTrigger):
    """Polls Slurm job ``job_id`` until it ends, logging its state changes and output; fires once with its end."""

    def __init__(self, *, job_id: str, name: str, settings: dict[str, Any], output: str = "", offset: int = 0,
                 poll_s: float = 10.0, carry: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.job_id, self.name, self.settings, self.output = str(job_id), name, dict(settings), output
        self.offset, self.poll_s, self.carry = int(offset), float(poll_s), dict(carry or {})

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"job_id": self.job_id, "name": self.name, "settings": self.settings, "output": self.output,
                 "offset": self.offset, "poll_s": self.poll_s, "carry": self.carry})

    def _event(self, state: str, tail: Any = None, message: str = "") -> TriggerEvent:
        """The event: this job, how it ended (its state, or NODE_FAIL / NEVER_RUNS / UNKNOWN as the trigger saw it),
        where the logged output ends, and whether a rank reported a user error in what was logged."""
        return TriggerEvent({**self.carry, "job_id": self.job_id, "name": self.name, "state": state,
                             "offset": line_offset(tail) if tail is not None else self.offset, "message": message,
                             "user_error": bool(getattr(tail, "user_error", False)), "output": self.output})

    async def _poll(self, settings: Any) -> Any:
        """The job's record, None when it cannot be read (logged); gives up (raises) after MAX_POLL_FAILURES."""
        from stagewise.airflow.backends import slurm

        for failures in range(1, MAX_POLL_FAILURES + 1):
            try:
                return await asyncio.to_thread(slurm.job_record, settings, self.job_id)
            except Exception as exc:  # noqa: BLE001 - the controller may be away for a moment; the job goes on
                self.log.warning("Slurm job %s: cannot read its state (%s), poll %d of %d", self.job_id, exc,
                                 failures, MAX_POLL_FAILURES)
                last = exc
                await asyncio.sleep(self.poll_s)
        raise RuntimeError(f"its state could not be read {MAX_POLL_FAILURES} times in a row: {last}")

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Poll as the backend's own wait does (stagewise.airflow.backends.slurm.wait): state changes, the output, a
        long queue wait (logged, not failed), a requeue (waited on: the script resumes) unless the run before lost a
        node (NODE_FAIL), a pending reason the job never leaves (NEVER_RUNS); fire once it ended."""
        from stagewise.airflow.backends import slurm

        settings = settings_from(self.settings)
        tail = tail_from(self.output, self.offset) if self.output else None
        seen, restarts, allocated, pending_since, warned_at = None, None, "", None, 0.0
        delays = slurm.poll_delays(self.poll_s)
        self.log.info("waiting for Slurm job %s (%s), polling every %.0f s at most", self.job_id, self.name, self.poll_s)
        while True:
            try:
                record = await self._poll(settings)
            except RuntimeError as exc:
                yield self._event("UNKNOWN", tail, str(exc))
                return
            for line in (await asyncio.to_thread(tail) if tail is not None else []):
                self.log.info("%s", line)
            restarts = record.restarts if restarts is None else restarts
            if record.restarts > restarts:
                down = slurm.lost_nodes(await asyncio.to_thread(slurm.node_states, settings, allocated))
                if down or "NODE FAILURE" in (tail.ends if tail is not None else []):
                    yield self._event("NODE_FAIL", tail, f"node(s) {', '.join(down) or allocated} failed mid-run "
                                                         f"(Slurm requeued it as restart {record.restarts})")
                    return
                self.log.info("Slurm job %s was requeued (restart %d): it restarts and resumes from its newest "
                              "checkpoint", self.job_id, record.restarts)
                restarts = record.restarts
            allocated = record.node_list or allocated
            if (record.state, record.reason) != seen:
                self.log.info("Slurm job %s: %s%s%s", self.job_id, record.state,
                              f" ({record.reason})" if record.reason else "",
                              f" on {record.node_list}" if record.state == "RUNNING" and record.node_list else "")
                seen = (record.state, record.reason)
            if record.ended:
                yield self._event(record.state, tail)
                return
            if record.state == "PENDING":
                if record.reason in slurm.NEVER_RUNS:
                    yield self._event("NEVER_RUNS", tail, f"Slurm job {self.job_id} can never start: {record.reason} "
                                                          f"(check the profile's {slurm.NEVER_RUNS[record.reason]})")
                    return
                now = time.monotonic()
                pending_since = pending_since if pending_since is not None else now
                if now - pending_since >= settings.queue_wait_warn_s and now - warned_at >= settings.queue_wait_warn_s:
                    self.log.warning("Slurm job %s is waiting in the queue (%.0f s so far): %s; not a failure, it starts "
                                     "when Slurm allocates it", self.job_id, now - pending_since,
                                     record.reason or "no reason given")
                    warned_at = now
            else:
                pending_since = None
            await asyncio.sleep(next(delays))

    async def on_kill(self) -> None:
        """The user marked the deferred task failed or successful, or cleared it: scancel its job."""
        from stagewise.airflow.backends import slurm

        self.log.warning("the task was stopped while deferred: cancelling Slurm job %s (%s)", self.job_id, self.name)
        await asyncio.to_thread(slurm.cancel, settings_from(self.settings), self.job_id)

    async def cleanup(self) -> None:
        """Nothing to release; never cancels the job (a triggerer restart hands the trigger on, the job runs on)."""
