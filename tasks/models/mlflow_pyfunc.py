"""A Stagewise bundle as an MLflow ``python_function`` model: ``mlflow.pyfunc.load_model("models:/<name>@champion")``.

The registered artifact holds the bundle (weights-only ``model.pt``), the spec's own source under ``code/`` and an
MLmodel file naming this module as its ``loader_module`` and ``code/`` as its ``code`` (MLflow puts that folder on
``sys.path`` before importing this module): loading runs no pickled code, it imports Stagewise and the bundle's spec
and loads the weights.
``predict`` takes raw rows (a pandas DataFrame with the key and the raw feature columns, as batch inference reads
them), preprocesses them as training did and returns the key with the spec's prediction columns.

Runs in any environment with ``mlflow``, ``torch`` and ``stagewise`` (no Airflow, no spec folder: the spec travels
with the model); stagewise.tracking.registry writes the MLmodel file, without the mlflow package and without torch,
when it registers a version.
"""

from __future__ import annotations

from typing import Any

from stagewise.core.errors import DataError
from stagewise.datasets.columns import flatten_features, layout_of
from stagewise.datasets.typed import fill_categories, typed_block, write_typed_slots
from stagewise.definitions.spec import batch_of
from stagewise.models.bundle import load_bundle


class BundleModel:
    """What pyfunc wraps: ``predict(DataFrame) -> DataFrame``, scoring on the CPU in float32."""

    def __init__(self, bundle: Any) -> None:
        self.bundle = bundle

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> Any:
        import numpy as np
        import pandas as pd
        import pyarrow as pa
        import torch


        prep = self.bundle.preprocessing
        key, layout = prep["key"], layout_of(prep)
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        columns = prep.get("columns") or prep["features"]
        missing = [name for name in [key, *columns] if name not in frame.columns]
        if missing:
            raise DataError(f"model input: column(s) {missing} the model needs are missing (it reads {[key, *columns]})")
        batch = pa.RecordBatch.from_pandas(frame[[key, *columns]], preserve_index=False)
        dense = [column.name for column in layout.columns if not column.typed]
        matrix = flatten_features(batch, dense, prep.get("feature_shapes") or {}, "model input")
        if not np.isfinite(matrix).all():
            row = int(np.flatnonzero(~np.isfinite(matrix).all(axis=1))[0])
            raise DataError(f"model input: row {row} (key {frame[key].iloc[row]!r}) has a null or non-finite feature")
        records = np.empty((len(frame), layout.words), dtype=np.float32)
        records[:, : layout.dense] = (matrix - np.asarray(prep["mean"])) / np.asarray(prep["std"])
        if layout.typed:
            block = typed_block(batch, layout, "model input")
            fill_categories(block, layout, prep.get("vocabularies") or {})
            if not block.keep.all():
                row = int(np.flatnonzero(~block.keep)[0])
                raise DataError(f"model input: row {row} (key {frame[key].iloc[row]!r}) has a null or non-finite value "
                                f"in a typed feature column")
            write_typed_slots(records, block, layout, None)
        inputs = torch.from_numpy(records)
        with torch.inference_mode():
            labels = torch.zeros(len(inputs), dtype=torch.int64)
            predicted = self.bundle.spec.predict(self.bundle.module(batch_of(self.bundle.spec, inputs, labels)[0]))
        result = {key: frame[key].to_numpy()}
        for name, tensor in predicted.items():
            values = tensor.detach().cpu().numpy()
            result[name] = list(values) if values.ndim > 1 else values
        return pd.DataFrame(result)


def _load_pyfunc(data_path: str) -> BundleModel:
    """MLflow's entry point for a ``loader_module``: the bundle file named by the MLmodel's ``data``."""
    return BundleModel(load_bundle(data_path))
