"""A long retention pass says how far it got: runs and files done, their rate, at most every PROGRESS_S seconds.

Run: a library; stagewise.upkeep's listing, study planning and removal each count into one :class:`Progress`.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable

log = logging.getLogger("stagewise.retention")

PROGRESS_S = 15.0  # a pass over a year of hourly runs takes minutes: never a silence longer than this between lines
# Called at each progress line: the pass's lock says it is alive (stagewise.upkeep.ledger).
heartbeat: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("retention_heartbeat", default=None)


class Progress:
    """Counts of one step (``what``: "listing runs", "removing") logged every ``every_s`` seconds, and at the end."""

    def __init__(self, what: str, total: int | None = None, unit: str = "runs") -> None:
        self.what, self.total, self.unit = what, total, unit
        self.every_s = PROGRESS_S
        self.items = self.files = 0
        self.began = self.last = time.monotonic()

    def add(self, items: int = 0, files: int = 0) -> None:
        self.items += items
        self.files += files
        if time.monotonic() - self.last >= self.every_s:
            self.say()

    def say(self, final: bool = False) -> None:
        self.last = time.monotonic()
        took = max(self.last - self.began, 1e-9)
        of = f"/{self.total:,}" if self.total is not None else ""
        log.info("%s%s: %s%s %s, %s file(s) in %.0f s (%.0f %s/s, %.0f files/s)", self.what, " done" if final else "",
                 f"{self.items:,}", of, self.unit, f"{self.files:,}", took, self.items / took, self.unit,
                 self.files / took)
        if (beat := heartbeat.get()) is not None:
            beat()

    def done(self) -> None:
        """The step's last line (only when it took long enough to have said anything before)."""
        if time.monotonic() - self.began >= self.every_s:
            self.say(final=True)
