"""What the remote backends (:mod:`.sagemaker`, :mod:`.kubernetes`) share while a job runs: where the project lives in
the runtime image, the user-error rule for a node's failure, and SIGTERM while the task waits.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

from stagewise.core.errors import USER_ERROR_EXIT

# Where the project lives in the runtime image (docker/runtime.Dockerfile's WORKDIR).
IMAGE_WORKDIR = "/opt/stagewise"
# A node that fails on the user's input (stagewise.core.errors.USER_ERROR_EXIT) reports this prefix in its failure
# message (SageMaker's /opt/ml/output/failure, the pod's termination message): no retry.
USER_ERROR_MARKER = "stagewise user error"


def is_user_error(message: str | None, exit_code: int | None = None) -> bool:
    """Whether a node's failure is the user's to fix (bad config or data): no Airflow retry."""
    return exit_code == USER_ERROR_EXIT or USER_ERROR_MARKER in (message or "").lower()


class Stopped(RuntimeError):
    """The task got SIGTERM (killed, marked failed) while its job ran; Airflow retries it if retries are left."""


@contextlib.contextmanager
def stop_on_sigterm(what: str) -> Iterator[None]:
    """Turn SIGTERM into :class:`Stopped` in the waiting task, so its ``finally`` stops or deletes the job.

    Airflow's own handler only calls the operator's on_kill (a Python task has none) and the process is
    SIGKILLed after a grace period; raising here unwinds the wait first. Outside the main thread nothing
    is installed (signals reach only the main thread).
    """
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        if callable(previous):
            previous(signum, frame)
        raise Stopped(f"{what} was stopped: the task got SIGTERM (killed or marked failed)")

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
