"""Error kinds that decide whether Airflow retries a sub-job.

A :class:`UserError` (bad config, bad data) makes the sub-job exit with :data:`USER_ERROR_EXIT`;
the launcher turns that into a failure without retry. Anything else is an infrastructure fault and
is retried with backoff.
"""

USER_ERROR_EXIT = 3


class UserError(Exception):
    """Bad input from the user: retrying cannot help. The message names the file, column, key or param."""


class DataError(UserError):
    """The input data breaks the declared schema or value rules."""


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed (CUDA's OutOfMemoryError, the CPU allocator's, Python's)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":  # torch's, without importing torch
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())
