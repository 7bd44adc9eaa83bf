"""A size-rotated log file for a long-running service's output: what ``make up`` writes each component's log through.

Run: ``SERVICE 2>&1 | python -m stagewise.airflow.service_log FILE [--max-bytes N] [--backups K]``

Appends standard input to FILE until the pipe closes. Before FILE would pass ``--max-bytes`` it becomes FILE.1 (FILE.1
becomes FILE.2, ...; the one past ``--backups`` is dropped), cut at a line's end where one fits, so a service's logs
take at most (backups + 1) x max-bytes. The defaults are scripts/airflow_up.sh's: 10 MiB and 4 backups, 50 MiB a
service. No Airflow import: it runs beside the service, not in it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

MAX_BYTES = 10 * 1024 * 1024
BACKUPS = 4
CHUNK = 64 * 1024


class RotatingFile:
    """An append-only file that rolls over to FILE.1 .. FILE.<backups> before it would pass ``max_bytes``."""

    def __init__(self, path: str, max_bytes: int = MAX_BYTES, backups: int = BACKUPS) -> None:
        if max_bytes < 1 or backups < 0:
            raise ValueError("max_bytes must be at least 1 and backups at least 0")
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self.file = open(path, "ab", buffering=0)  # unbuffered: a line is on disk once the service wrote it
        self.size = self.file.tell()

    def write(self, data: bytes) -> None:
        while data:
            room = self.max_bytes - self.size
            if len(data) <= room:
                self._append(data)
                return
            cut = data.rfind(b"\n", 0, room) + 1  # the whole lines that still fit
            if cut == 0 and self.size == 0:
                cut = room  # one line longer than a whole file: split it rather than grow past the bound
            if cut:
                self._append(data[:cut])
                data = data[cut:]
            self.rollover()

    def _append(self, data: bytes) -> None:
        self.file.write(data)
        self.size += len(data)

    def rollover(self) -> None:
        """FILE -> FILE.1 -> ... -> FILE.<backups> (the oldest dropped), then a new empty FILE."""
        self.file.close()
        if self.backups == 0:
            os.remove(self.path)
        else:
            for n in range(self.backups - 1, 0, -1):
                if os.path.exists(f"{self.path}.{n}"):
                    os.replace(f"{self.path}.{n}", f"{self.path}.{n + 1}")
            os.replace(self.path, f"{self.path}.1")
        self.file = open(self.path, "ab", buffering=0)
        self.size = 0

    def close(self) -> None:
        self.file.close()


def copy(source: int, target: RotatingFile) -> None:
    """Copy everything read from file descriptor ``source`` into ``target`` until end of file.

    A write that fails (a full disk) drops that chunk and the next one tries again: the service must never see its
    output pipe break, which would end it."""
    while chunk := os.read(source, CHUNK):
        try:
            target.write(chunk)
        except OSError as exc:
            print(f"stagewise.airflow.service_log: {target.path}: {exc}; {len(chunk)} bytes dropped", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Append standard input to FILE, rotating it by size.")
    parser.add_argument("file", help="the log file; its rotated copies are FILE.1 .. FILE.<backups>")
    parser.add_argument("--max-bytes", type=int, default=MAX_BYTES, help="largest size of one file (default 10 MiB)")
    parser.add_argument("--backups", type=int, default=BACKUPS, help="rotated files kept (default 4)")
    args = parser.parse_args(argv)
    # make down stops the service's whole process group, this writer with it: it keeps reading until the service and
    # its children have closed the pipe, so their last lines (a shutdown message, a traceback) are kept.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    target = RotatingFile(args.file, args.max_bytes, args.backups)
    try:
        copy(sys.stdin.fileno(), target)
    finally:
        target.close()


if __name__ == "__main__":
    main()
