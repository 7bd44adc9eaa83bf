"""The built-in model spec by its public path: configs name ``tasks.model:MLPClassifier``, and so do the bundles
registered with it, so this path stays while the implementation lives in ``tasks.models.mlp``.

Nothing inside ``tasks`` imports this module; the config's default ``model.spec`` loads it by name.
"""

from __future__ import annotations

from tasks.models.mlp import MLPClassifier

__all__ = ["MLPClassifier"]
