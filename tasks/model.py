"""The built-in model spec by its public path: configs name ``stagewise.model:MLPClassifier``, and so do the bundles
registered with it, so this path stays while the implementation lives in ``stagewise.models.mlp``.

Nothing inside ``tasks`` imports this module; the config's default ``model.spec`` loads it by name.
"""

from __future__ import annotations

from stagewise.models.mlp import MLPClassifier

__all__ = ["MLPClassifier"]
