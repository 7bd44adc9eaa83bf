"""Map an instance profile onto the Airflow operator arguments that enforce it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from stagewise.definitions.config import Profile


def task_kwargs(profile: Profile) -> dict[str, Any]:
    """Pool and slots bound concurrent use of cores/GPUs; queue routes to the right worker; the weight orders what a free
    slot runs next; retries back off."""
    return {
        "pool": profile.pool,
        "pool_slots": profile.pool_slots,
        "queue": profile.queue,
        "priority_weight": profile.priority_weight,
        "weight_rule": profile.weight_rule,
        "retries": profile.retries,
        "retry_delay": timedelta(seconds=profile.retry_delay_s),
        "retry_exponential_backoff": profile.retry_backoff if profile.retry_backoff > 1 else 0,
        "max_retry_delay": timedelta(seconds=profile.max_retry_delay_s),
        "execution_timeout": timedelta(seconds=profile.execution_timeout_s),
    }
