"""Start a torchrun rank that dies with its agent (Linux), then become the rank's own command.

Run (stagewise.training.local_torchrun makes it every rank's command): ``python -m stagewise.training.rank_guard AGENT_PID COMMAND [ARG...]``

torch's elastic agent starts each rank in a session of its own and sets no parent-death signal, so a rank whose
agent is SIGKILLed runs on as an orphan. The parent-death signal set here survives the exec into COMMAND.
Imports nothing heavy: it runs once per rank start.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main() -> None:
    agent, command = int(sys.argv[1]), sys.argv[2:]
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is not None:  # Linux; elsewhere the rank runs unguarded
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
        if os.getppid() != agent:  # the agent died before the signal was armed: nothing would end this rank
            sys.exit(f"stagewise.training.rank_guard: torchrun agent {agent} is gone; not starting {command[0]}")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
