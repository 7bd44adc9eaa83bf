"""The one public module: everything a user's model spec or own torchrun script imports.

Your own model in every stage: subclass :class:`ModelSpec` (or :class:`Classifier` / :class:`Regressor`) and
name it in the pipeline config (``model.spec: "stagewise.examples.digits_cnn:DigitsCNN"``); see
``stagewise.definitions.spec`` for what a spec answers. Your own script, as a stage or as each sweep trial::

    from stagewise.spec import build_model, checkpoint_dir, context, read_split, report, save_model

This module only re-exports (the definitions live in ``stagewise.definitions.spec``, ``.metrics`` and ``stagewise.scripting.runtime``);
nothing inside ``tasks`` imports it, so the framework's internals can change without touching this interface.
"""

from __future__ import annotations

from stagewise.core.errors import UserError
from stagewise.definitions.metrics import Average, MetricState, confusion_matrix, log_odds, score_histogram
from stagewise.definitions.rows import Features, InputColumn
from stagewise.definitions.spec import Classifier, DataInfo, ModelSpec, Regressor, SpecRef
from stagewise.scripting.runtime import (
    Context,
    build_model,
    checkpoint_dir,
    context,
    features_of,
    hyperparameters,
    init_from,
    load_optimizer,
    load_state,
    read_split,
    report,
    save_model,
    save_state,
)

__all__ = [
    "Average",
    "Classifier",
    "Context",
    "DataInfo",
    "Features",
    "InputColumn",
    "MetricState",
    "ModelSpec",
    "Regressor",
    "SpecRef",
    "UserError",
    "build_model",
    "checkpoint_dir",
    "confusion_matrix",
    "context",
    "features_of",
    "hyperparameters",
    "init_from",
    "load_optimizer",
    "load_state",
    "log_odds",
    "read_split",
    "report",
    "save_model",
    "save_state",
    "score_histogram",
]
