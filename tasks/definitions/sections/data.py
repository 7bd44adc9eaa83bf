"""The input table and its preprocessing: columns, the split and the cleaning limits."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from stagewise.definitions.intervals import fields_in
from stagewise.definitions.sections.base import StrictModel, check_filesystem


class FeatureColumn(StrictModel):
    """A feature column declared with its type: a fixed-shape tensor, integer or categorical ids, or a variable-length list."""

    column: str = Field(description="The raw column.")
    dtype: Literal["float32", "int64", "categorical"] = Field(
        "float32", description="float32 (standardised unless normalize: false), int64 (exact integer ids, never "
                               "normalised) or categorical (strings or integers -> ids of the training split's vocabulary).")
    shape: list[Annotated[int, Field(ge=1, le=1 << 20)]] | None = Field(
        None, min_length=1, max_length=8, description="A list column with this fixed per-row tensor shape, e.g. [1, 8, 8] (up to 8 "
                                                      "dimensions of at most 1048576); empty: a scalar.")
    max_length: int | None = Field(
        None, ge=1, le=65536, description="A variable-length list column of up to this many values a row (at most 65536), padded per batch with a mask.")
    truncate: bool = Field(False, description="Keep the first max_length values of a longer row instead of failing on it.")
    normalize: bool | None = Field(
        None, description="float32 fixed-shape columns: standardise with the training data's mean/std (empty: true for a "
                          "tensor column, dataset.normalize for a scalar).")
    max_categories: int = Field(
        100_000, ge=1, le=100_000_000, description="categorical: keep the most frequent values of the training split (at "
                                                   "most 100000000); others get id 0.")

    @model_validator(mode="after")
    def _consistent(self) -> FeatureColumn:
        where = f"feature column '{self.column}'"
        if self.shape is not None and self.max_length is not None:
            raise ValueError(f"{where}: give shape (fixed) or max_length (variable-length), not both")
        if self.truncate and self.max_length is None:
            raise ValueError(f"{where}: truncate applies to a variable-length column (max_length)")
        if self.normalize and (self.dtype != "float32" or self.max_length is not None):
            kind = f"a {self.dtype} column" if self.dtype != "float32" else "a variable-length column"
            raise ValueError(f"{where}: {kind} is never normalised (normalize: true); its values reach the spec as they are")
        if self.dtype == "categorical" and (self.shape is not None or self.max_length is not None):
            raise ValueError(f"{where}: a categorical column is one value a row (no shape or max_length)")
        if self.max_categories != 100_000 and self.dtype != "categorical":
            raise ValueError(f"{where}: max_categories applies to dtype categorical")
        return self

    @property
    def typed(self) -> bool:
        """Not a plain float32 element of the feature vector: ids or a variable-length list."""
        return self.dtype != "float32" or self.max_length is not None


class Dataset(StrictModel):
    """The input table: where it is and which columns play which part."""

    uri: str = Field(description="Parquet file or folder of raw shards; relative paths are under storage_root.")
    key: str = Field(description="Unique row key column (integer or string); drives the split.")
    label: str = Field(description="Label column: integer classes with num_classes, else a float target (regression).")
    features: list[str | FeatureColumn] | str = Field(
        description="Feature columns: names, or {column, dtype, shape or max_length} typed ones; or a prefix ending in '*' (e.g. 'px_*').")
    num_classes: int | None = Field(None, ge=2, le=10_000_000, description=(
        "Classes of an integer label in [0, num_classes) (at most 10000000); null: the label is a float "
        "target."))
    normalize: bool = Field(True, description="Standardise the plain (scalar) feature columns; false keeps them as they are.")
    demo_data: Literal["digits", "digits-images", "diabetes", "synthetic", "tokens", "imbalanced"] = Field(
        "digits", description="What `python -m stagewise.data demo` (make demo) writes into uri when it holds no shards.")

    @field_validator("uri")
    @classmethod
    def _interval_placeholders(cls, value: str) -> str:
        fields_in(value, "dataset.uri")  # a run's first task fills them (stagewise.definitions.intervals)
        return value

    @field_validator("features", mode="before")
    @classmethod
    def _tensor_columns(cls, value: Any) -> Any:
        # One clear message per bad {column, shape} entry instead of pydantic's error for every member of the union.
        if not isinstance(value, list):
            return value
        items = []
        for index, item in enumerate(value):
            if isinstance(item, dict):
                try:
                    item = FeatureColumn.model_validate(item)
                except ValidationError as exc:
                    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
                    raise ValueError(f"item {index} {item}: {problems}") from None
            items.append(item)
        return items

    @field_validator("features")
    @classmethod
    def _features_not_empty(cls, value: list[str | FeatureColumn] | str) -> list[str | FeatureColumn] | str:
        if isinstance(value, str) and not value.endswith("*"):
            raise ValueError("a string must be a prefix ending in '*', e.g. 'px_*'; otherwise give a list")
        if isinstance(value, list) and not value:
            raise ValueError("at least one feature column is needed")
        if isinstance(value, list):
            names = [item if isinstance(item, str) else item.column for item in value]
            if len(set(names)) != len(names):
                raise ValueError("feature columns repeat")
        return value

    @property
    def shapes(self) -> dict[str, list[int]]:
        """Declared float32 tensor columns -> their shapes (flattened into the feature vector)."""
        return {item.column: list(item.shape) for item in self.declared.values() if item.shape is not None and not item.typed}

    @property
    def declared(self) -> dict[str, FeatureColumn]:
        """Columns declared with their type ({column: ...} entries), by name."""
        return {} if isinstance(self.features, str) else {
            item.column: item for item in self.features if isinstance(item, FeatureColumn)}

    @field_validator("uri")
    @classmethod
    def _uri_filesystem(cls, value: str) -> str:
        return check_filesystem(value)


class Split(StrictModel):
    """Fractions of rows, chosen by a hash of the row key, held out from training."""

    validation: float = Field(0.15, gt=0, lt=1, description="Fraction of rows for validation.")
    test: float = Field(0.15, gt=0, lt=1, description="Fraction of rows for test.")
    salt: str = Field("stagewise", description="Hash salt; change it to draw a different split.")

    @model_validator(mode="after")
    def _leaves_training_rows(self) -> Split:
        if self.validation + self.test >= 0.9:
            raise ValueError(f"validation + test = {self.validation + self.test:g} leaves too little for training (< 0.1)")
        return self


class Preprocess(StrictModel):
    """Sharded cleaning, statistics, normalisation and split."""

    profile: str = Field(description="Instance profile of each shard task.")
    split: Split = Field(default_factory=Split, description="Held-out fractions.")
    max_null_fraction: float = Field(0.5, ge=0, le=1, description="Fail when more rows than this are dropped as dirty.")
