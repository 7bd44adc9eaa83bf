"""The one public module: everything a user's model spec or own torchrun script imports.

Your own model in every stage: subclass :class:`ModelSpec` (or :class:`Classifier` / :class:`Regressor`) and
name it in the pipeline config (``model.spec: "examples.digits_cnn:DigitsCNN"``); see
``tasks.definitions.spec`` for what a spec answers. Your own script, as a stage or as each sweep trial::

    from tasks.spec import build_model, checkpoint_dir, context, read_split, report, save_model

This module only re-exports (the definitions live in ``tasks.definitions.spec`` and ``tasks.scripting.runtime``);
nothing inside ``tasks`` imports it, so the framework's internals can change without touching this interface.
"""

from __future__ import annotations

from tasks.core.errors import UserError
from tasks.definitions.spec import Average, Classifier, DataInfo, ModelSpec, Regressor, SpecRef
from tasks.scripting.runtime import (
    Context,
    build_model,
    checkpoint_dir,
    context,
    hyperparameters,
    init_from,
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
    "ModelSpec",
    "Regressor",
    "SpecRef",
    "UserError",
    "build_model",
    "checkpoint_dir",
    "context",
    "hyperparameters",
    "init_from",
    "load_state",
    "read_split",
    "report",
    "save_model",
    "save_state",
]
