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
