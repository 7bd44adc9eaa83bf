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


def main(argv: list[str] | None = None) -> None:
    import argparse  # stdlib and light: the rank's start stays cheap

    parser = argparse.ArgumentParser(prog="python -m stagewise.training.rank_guard",
                                     description="Run COMMAND as a torchrun rank that dies with its agent (Linux).")
    parser.add_argument("agent", type=int, metavar="AGENT_PID", help="the torchrun agent's pid")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND", help="the rank's command and its args")
    args = parser.parse_args(argv)
    agent, command = args.agent, args.command
    if not command:
        parser.error("give the rank's COMMAND after AGENT_PID")
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
