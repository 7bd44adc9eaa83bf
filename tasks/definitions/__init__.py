"""Definitions: the model-spec types, the framework's hyperparameters, the config schema and how a config file loads.

Above the leaves (``stagewise.core``), below every library; nothing here imports torch at module level except
``spec`` (the spec types are torch types), so ``config`` and ``loading`` stay light enough for DAG parsing.
"""
