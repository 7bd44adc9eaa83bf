"""What every config section shares: the strict base model, the config error, and the bounds of numbers."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from stagewise.core.errors import UserError
from stagewise.definitions.metric_names import RANGES

# Optuna keeps a study's name in at most 512 characters (its RDB schema).
MAX_STUDY_NAME = 512
# Upper bounds of counts no real deployment reaches: a value past one is a typo (1e18 slots, a batch of 10^12), refused
# naming its key before it reaches Airflow, a loader or an allocation. Each field's description states its bound.
MAX_BATCH = 1 << 24  # rows in one batch or optimizer step: 16,777,216
MAX_ROWS = 10**12  # rows of a data set (a sweep's row budget, an inference shard)
MAX_STEPS = 10**9  # optimizer steps (warmup, checkpoint and measurement intervals)
MAX_EPOCHS = 10_000
MAX_TRIALS = 10_000
MAX_SECONDS = 30 * 86_400  # 30 days: a task, a job or a wait
MAX_SEED = 2**32 - 1  # numpy's seeds are 32-bit
# In a journal path, the study's name (made safe for a file name): a file per study (stagewise.study.studies).
STUDY_PLACEHOLDER = "{study}"
# Where the sweep's journal lives under storage_root when sweep.storage is unset: a file per study, since Optuna
# replays a journal whole on open (one file of 500 studies took 0.51 s a worker; docs/sweeps.md).
DEFAULT_JOURNAL = "optuna/studies/{study}.journal"
# The one journal of every study that earlier releases kept there: still read for studies made before the move.
LEGACY_JOURNAL = "optuna/optuna.journal"
# What well-known metrics can be: a limit outside can never be met nor missed, so it is a typo.
METRIC_RANGES = {**dict.fromkeys(("precision", "recall", "f1", "auc"), (0.0, 1.0)), "mse": (0.0, math.inf), **RANGES}


class ConfigError(UserError):
    """The pipeline config is invalid; the message names the file, key and reason."""


class StrictModel(BaseModel):
    """The base of every config section: strict, frozen, finite."""

    # Unknown keys are refused so a typo never silently falls back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # a NaN or inf limit would mean none


def filesystem_problem(uri: str) -> str | None:
    """Why fsspec cannot open ``uri``'s scheme here (unknown, or its package not installed), or None."""
    if "://" not in uri:
        return None
    import importlib.util

    from fsspec.registry import known_implementations, registry

    scheme = uri.split("://", 1)[0].lower()
    if scheme in registry:
        return None
    known = known_implementations.get(scheme)
    if known is None:
        return f"scheme '{scheme}://' has no fsspec filesystem; use a local path, file:// or s3://"
    package = known["class"].split(".", 1)[0]
    # find_spec looks the package up without importing it, so loading a config stays fast.
    if importlib.util.find_spec(package) is None:
        hint = known.get("err") or f"install {package}"
        return f"scheme '{scheme}://' needs the {package} package, which is not installed ({hint}: pip install {package})"
    return None


def check_filesystem(uri: str) -> str:
    problem = filesystem_problem(uri)
    if problem:
        raise ValueError(problem)
    return uri
