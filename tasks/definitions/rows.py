"""How a processed row is laid out, and the typed view of a batch of rows a spec receives.

A processed row is one fixed-width record: the float32 elements first (plain and tensor float columns,
standardised or not, then the slots of variable-length float columns), then, when the data set declares typed
columns, int64 words (integer and categorical ids, the slots of variable-length integer columns and each
variable-length column's row length). Fixed-width rows keep the loaders' row moves, the row-group shuffle and
device residency unchanged; a variable-length column costs ``max_length`` slots a row on disk and on the device,
and each batch is cut to the longest row it holds.

A data set of float columns only keeps its record as before and a spec's ``batch`` receives the float32 matrix; one
with a typed column receives :class:`Features`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # torch loads only where a batch is decoded: preprocessing and DAG parsing never pay for it
    import torch

Dtype = Literal["float32", "int64", "categorical"]


@dataclass(frozen=True, kw_only=True)
class InputColumn:
    """One declared input column and where its values sit in the record."""

    name: str
    """The raw column's name."""
    dtype: Dtype
    """float32, int64 (exact integer ids) or categorical (ids of a vocabulary learnt on the training split)."""
    shape: list[int]
    """Per-row shape: [] for a scalar, the declared shape of a tensor column, [max_length] for a variable-length one."""
    variable: bool = False
    """A list column whose rows hold 0..max_length values; batches are padded to their longest row, with a mask."""
    offset: int = 0
    """First element in its part of the record: the float32 part for float32, the int64 part otherwise."""
    length_slot: int | None = None
    """Variable-length only: the int64 slot holding the row's length."""
    truncate: bool = False
    """Variable-length only: a longer row keeps its first max_length values (else it is an error)."""
    num_categories: int | None = None
    """Categorical only: vocabulary size + 1 (id 0 is a value not in the vocabulary, or a missing one)."""
    max_value: int | None = None
    """int64 only: the largest id in the data set (an embedding over it needs max_value + 1 rows)."""
    normalize: bool = False
    """float32 only: the elements were standardised with the training data's mean and std."""

    @property
    def size(self) -> int:
        """Slots the column takes in its part."""
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype == "float32"

    @property
    def typed(self) -> bool:
        """Stored in typed slots (ids or a variable-length list), not in the float feature vector."""
        return not self.is_float or self.variable

    def describe(self) -> str:
        """How the config declares it, for messages: e.g. 'declared int64 with max_length 16'."""
        return f"declared {self.dtype}" + (f" with max_length {self.shape[0]}" if self.variable else
                                           f" with shape {self.shape}" if self.shape else "")


@dataclass(frozen=True, kw_only=True)
class RowLayout:
    """The record of a processed row: ``float_slots`` float32 then ``int_slots`` int64 (8-byte aligned)."""

    columns: list[InputColumn]
    """Every feature column, in declaration order."""
    float_slots: int
    """float32 elements of a record."""
    int_slots: int = 0
    """int64 elements of a record (0: a float-only data set, whose record is today's feature vector)."""

    def __post_init__(self) -> None:
        columns = [c if isinstance(c, InputColumn) else InputColumn(**c) for c in self.columns]
        object.__setattr__(self, "columns", columns)

    @property
    def typed(self) -> bool:
        """A spec receives :class:`Features` (else the float32 matrix itself)."""
        return bool(self.int_slots) or any(c.variable for c in self.columns)

    @property
    def int_offset(self) -> int:
        """float32 words before the int64 part (even, so every int64 is 8-byte aligned)."""
        return self.float_slots + self.float_slots % 2

    @property
    def words(self) -> int:
        """float32-sized words of one record."""
        return self.int_offset + 2 * self.int_slots if self.int_slots else self.float_slots

    @property
    def dense(self) -> int:
        """float32 elements of fixed-shape float columns: the leading block a spec reads as ``features.dense``."""
        return sum(c.size for c in self.columns if c.is_float and not c.variable)

    @functools.cached_property
    def _by_name(self) -> dict[str, InputColumn]:
        return {c.name: c for c in self.columns}

    def column(self, name: str) -> InputColumn:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no input column '{name}'; the data set declares {[c.name for c in self.columns]}") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def sized(self, categories: dict[str, int], max_values: dict[str, int]) -> RowLayout:
        """This layout with each categorical column's vocabulary size and each int64 column's largest id filled in."""
        columns = [replace(c, num_categories=categories.get(c.name, 0) + 1) if c.dtype == "categorical" else
                   replace(c, max_value=max_values.get(c.name)) if c.dtype == "int64" else c for c in self.columns]
        return replace(self, columns=columns)

    def decode(self, records: torch.Tensor) -> torch.Tensor | Features:
        """A batch as its spec sees it: ``records`` itself for a float-only layout, else its :class:`Features`."""
        return Features(records, self) if self.typed else records

    def probe(self, rows: int, device: Any = "cpu") -> torch.Tensor:
        """Zero records whose variable-length columns hold one value each: a batch that runs through any model."""
        import torch

        records = torch.zeros((rows, self.words), dtype=torch.float32, device=device)
        ints = records[:, self.int_offset:].view(torch.int64) if self.int_slots else None
        for column in self.columns:
            if column.variable and ints is not None and column.length_slot is not None:
                ints[:, column.length_slot] = 1
        return records


def float_only_layout(features: list[str], shapes: dict[str, list[int]] | None = None,
                      columns: list[str] | None = None) -> RowLayout:
    """The layout of a manifest written before typed columns: every feature a float32 element, in order."""
    shapes = shapes or {}
    inputs, offset = [], 0
    for name in columns or features:
        shape = list(shapes.get(name, []))
        inputs.append(InputColumn(name=name, dtype="float32", shape=shape, offset=offset, normalize=True))
        offset += math.prod(shape)
    return RowLayout(columns=inputs, float_slots=len(features))


class Features(Mapping[str, Any]):
    """A batch of rows by column, for a data set with typed or variable-length columns.

    ``features["tokens"]`` is an int64 (rows, L) tensor for a variable-length integer column, padded with 0 to the
    batch's longest row L, ``features.mask("tokens")`` marks the real values and ``features.lengths("tokens")`` counts
    them; ``features.ragged("tokens")`` gives (values, offsets) for ``nn.EmbeddingBag`` or your own packing. An int64
    or categorical scalar column is (rows,) int64, a fixed-shape one (rows, *shape); float columns are float32, and
    ``features.dense`` is every fixed-shape float column side by side (the data set's feature vector).
    """

    def __init__(self, records: torch.Tensor, layout: RowLayout) -> None:
        import torch

        self.records, self.layout = records, layout
        self._ints = records[:, layout.int_offset:].view(torch.int64) if layout.int_slots else None
        self._longest: dict[str, int] = {}
        self._masks: dict[str, torch.Tensor] = {}  # a spec may ask twice; on a GPU each is a few kernel launches

    def __len__(self) -> int:
        return len(self.layout.columns)

    def __iter__(self) -> Iterator[str]:
        return iter(c.name for c in self.layout.columns)

    def __repr__(self) -> str:
        return f"Features({len(self.records)} rows: {', '.join(self)})"

    @property
    def rows(self) -> int:
        return len(self.records)

    @property
    def device(self) -> torch.device:
        return self.records.device

    @property
    def dense(self) -> torch.Tensor:
        """(rows, dense) float32: the fixed-shape float columns, in declaration order."""
        return self.records[:, : self.layout.dense]

    def _slots(self, column: InputColumn, width: int) -> torch.Tensor:
        part = self.records if column.is_float else self._ints
        assert part is not None
        return part[:, column.offset : column.offset + width]

    def lengths(self, name: str) -> torch.Tensor:
        """(rows,) int64: values each row of variable-length column ``name`` holds."""
        column = self._variable(name)
        assert self._ints is not None and column.length_slot is not None
        return self._ints[:, column.length_slot]

    def longest(self, name: str) -> int:
        """The batch's longest row of ``name`` (a host value: on a GPU, one sync per column and batch)."""
        if name not in self._longest:
            lengths = self.lengths(name)
            self._longest[name] = int(lengths.max()) if len(lengths) else 0
        return self._longest[name]

    def mask(self, name: str) -> torch.Tensor:
        """(rows, L) bool, True where ``features[name]`` holds a real value rather than padding."""
        import torch

        if name not in self._masks:
            width = self.longest(name)
            self._masks[name] = torch.arange(width, device=self.device) < self.lengths(name)[:, None]
        return self._masks[name]

    def ragged(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, offsets): the rows' values back to back and where each row starts (``nn.EmbeddingBag``'s input)."""
        import torch

        values = self[name][self.mask(name)]
        lengths = self.lengths(name)
        offsets = torch.zeros(len(lengths), dtype=torch.int64, device=self.device)
        offsets[1:] = torch.cumsum(lengths[:-1], 0)
        return values, offsets

    def _variable(self, name: str) -> InputColumn:
        column = self.layout.column(name)
        if not column.variable:
            raise KeyError(f"input column '{name}' has a fixed shape {column.shape}: it has no lengths or mask")
        return column

    def __getitem__(self, name: str) -> torch.Tensor:
        column = self.layout.column(name)
        if column.variable:
            return self._slots(column, self.longest(name))
        values = self._slots(column, column.size)
        return values.reshape(len(values), *column.shape)
