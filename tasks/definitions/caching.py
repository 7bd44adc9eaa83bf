"""The ``cache:`` section of a pipeline config: which sub-jobs may reuse an earlier run's outputs (stagewise.reuse)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

CACHED_KINDS = ("preprocess", "sweep", "stage", "evaluate", "inference")


class Cache(BaseModel):
    """Step caching across runs of one pipeline: ``cache: true`` turns on every kind, a mapping picks kinds. A sub-job
    reuses another run's committed outputs only when the fingerprint of its inputs (data content, config, upstream
    artifacts, code) matches, and says so in its log, report.json, report.html and the model card."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preprocess: bool = Field(False, description="Reuse the split, normalised data of a run that read the same raw bytes under the same rules.")
    sweep: bool = Field(False, description="Reuse the study (best params, trials) of a run with the same data and search.")
    stage: bool = Field(False, description="Reuse a training stage's checkpoint and model trained from the same inputs.")
    evaluate: bool = Field(False, description="Reuse the test metrics of the same model on the same test split.")
    inference: bool = Field(False, description="Reuse the predictions of the same model version over the same input bytes.")

    @model_validator(mode="before")
    @classmethod
    def _all_kinds(cls, raw: Any) -> Any:
        # `cache: true` (or false) is the whole pipeline's switch.
        return dict.fromkeys(CACHED_KINDS, raw) if isinstance(raw, bool) else raw

    def enabled(self, kind: str) -> bool:
        """Whether sub-jobs of ``kind`` (one of CACHED_KINDS) may reuse other runs' outputs."""
        return bool(getattr(self, kind))
