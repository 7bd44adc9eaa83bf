"""The bookkeeping profile: where a run's light tasks (start_run, plan_*, reduce, commit_*, register, gate, report,
ingest) run, apart from the heavy ones.

Run: nothing to run; the config schema fills these defaults in (``PipelineConfig``) and the DAG wiring gives every
light task the profile named :data:`BOOKKEEPING`. A pipeline overrides it with ``profiles.bookkeeping:``; the keys it
leaves out keep the defaults below.

Why a profile of their own: in the compute pool a light task waits for a slot behind the training and sweep tasks
of other runs, and Airflow's default weight rule (downstream) ranks those above it. Its own pool and a fixed
(``absolute``) weight put it first, so a run's next step starts within seconds. Every profile's weight rule is
absolute by default: Airflow's downstream rule adds the raw weights of every downstream task, these light tasks' too,
so a heavy task upstream of them would outrank them (and start new runs' work before older runs finish).
"""

from __future__ import annotations

from typing import Any

BOOKKEEPING = "bookkeeping"  # the reserved profile name
BOOKKEEPING_POOL = "stagewise_bookkeeping"
# Far above the other profiles' default (1), so a light task is picked first even beside a team's own weights.
BOOKKEEPING_WEIGHT = 10_000
DEFAULT_PROFILE: dict[str, Any] = {"pool": BOOKKEEPING_POOL, "pool_slots": 1, "priority_weight": BOOKKEEPING_WEIGHT,
                                   "weight_rule": "absolute", "retries": 1, "retry_delay_s": 5.0,
                                   "execution_timeout_s": 3600.0}
# In-process steps that mostly wait on storage: a handful side by side costs the worker little.
DEFAULT_POOL: dict[str, Any] = {"slots": 8, "description": "Stagewise's light tasks (plans, commits, reports, ingest)"}


def with_bookkeeping(raw: Any) -> Any:
    """A raw config with ``profiles.bookkeeping`` (the user's keys over :data:`DEFAULT_PROFILE`; its queue, unless
    given, the preprocess profile's, so a Celery deployment routes it to a worker it already runs) and, when that
    profile draws from :data:`BOOKKEEPING_POOL`, the pool declared; anything not a config is left to the checks."""
    if not isinstance(raw, dict) or not isinstance(raw.get("profiles"), dict):
        return raw
    profiles = raw["profiles"]
    theirs = profiles.get(BOOKKEEPING, {})
    if not isinstance(theirs, dict):
        return raw  # not a mapping: the Profile model names the error
    preprocess = raw.get("preprocess") if isinstance(raw.get("preprocess"), dict) else {}
    source = profiles.get(preprocess.get("profile"))
    queue = source.get("queue") if isinstance(source, dict) and isinstance(source.get("queue"), str) else None
    profile = {**DEFAULT_PROFILE, **({"queue": queue} if queue else {}), **theirs}
    raw = {**raw, "profiles": {**profiles, BOOKKEEPING: profile}}
    pools = raw.get("pools") or {}  # an empty `pools:` is YAML's null
    if isinstance(pools, dict) and profile.get("pool") == BOOKKEEPING_POOL and BOOKKEEPING_POOL not in pools:
        raw = {**raw, "pools": {**pools, BOOKKEEPING_POOL: dict(DEFAULT_POOL)}}
    return raw
