"""The demo data sets: scikit-learn's bundled digits and diabetes, and a synthetic generator of any size.

``python -m stagewise.data`` writes them; each is raw Parquet shards with an integer row key ``row_id``, a
label (an integer class, or the diabetes' float ``target``) and numeric feature columns.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stagewise.core import storage

log = logging.getLogger("stagewise.data")

def _write_shards(out_uri: str, table: pa.Table, num_shards: int) -> list[str]:
    storage.makedirs(out_uri)
    bounds = np.linspace(0, table.num_rows, num_shards + 1).astype(int)
    uris = []
    for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        uri = storage.join(out_uri, f"part-{index:05d}.parquet")
        fs, path = storage.filesystem(uri)
        with fs.open(path, "wb") as handle:
            pq.write_table(table.slice(start, stop - start), handle)
        uris.append(uri)
    return uris


def write_digits(out_uri: str, num_shards: int = 4) -> list[str]:
    """scikit-learn's bundled 8x8 digits (1,797 rows, 10 classes) as raw shards, columns px_00..px_63."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    columns = {"row_id": pa.array(np.arange(len(digits.target), dtype=np.int64))}
    for index in range(digits.data.shape[1]):
        columns[f"px_{index:02d}"] = pa.array(digits.data[:, index].astype(np.float64))
    columns["label"] = pa.array(digits.target.astype(np.int64))
    uris = _write_shards(out_uri, pa.table(columns), num_shards)
    log.info("wrote %d digits rows in %d shards to %s", len(digits.target), num_shards, out_uri)
    return uris


def write_digits_images(out_uri: str, num_shards: int = 4) -> list[str]:
    """The same digits with each 8x8 image in one ``image`` column (fixed_size_list<double>[64], row-major)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = digits.data.astype(np.float64)
    image = pa.FixedSizeListArray.from_arrays(pa.array(pixels.reshape(-1)), pixels.shape[1])
    table = pa.table({"row_id": pa.array(np.arange(len(digits.target), dtype=np.int64)), "image": image,
                      "label": pa.array(digits.target.astype(np.int64))})
    uris = _write_shards(out_uri, table, num_shards)
    log.info("wrote %d digits image rows in %d shards to %s", len(digits.target), num_shards, out_uri)
    return uris


def write_diabetes(out_uri: str, num_shards: int = 2) -> list[str]:
    """scikit-learn's bundled diabetes (442 rows): 10 float features at their raw scale, the float ``target``
    (disease progression after a year, about 25..346) unscaled."""
    from sklearn.datasets import load_diabetes

    diabetes = load_diabetes(scaled=False)
    columns = {"row_id": pa.array(np.arange(len(diabetes.target), dtype=np.int64))}
    for index, name in enumerate(diabetes.feature_names):
        columns[name] = pa.array(diabetes.data[:, index].astype(np.float64))
    columns["target"] = pa.array(diabetes.target.astype(np.float64))
    uris = _write_shards(out_uri, pa.table(columns), num_shards)
    log.info("wrote %d diabetes rows in %d shards to %s", len(diabetes.target), num_shards, out_uri)
    return uris


def synthetic_table(num_rows: int, num_features: int = 32, num_classes: int = 10, seed: int = 0,
                    dirty_fraction: float = 0.0, first_key: int = 0, noise: float = 1.1) -> pa.Table:
    """A Gaussian-mixture classification table with a learnable, not trivially separable signal.

    Each class has a centroid; features are centroid plus noise, then a fixed random rotation and a
    per-column scale and offset so that normalisation matters. ``dirty_fraction`` of rows get a null
    feature, to exercise cleaning; a larger ``noise`` makes the classes overlap more (a harder task).
    """
    rng = np.random.default_rng(seed)
    structure = np.random.default_rng(12345)  # same class geometry for every chunk and seed
    centroids = structure.normal(0.0, 1.0, size=(num_classes, num_features))
    rotation, _ = np.linalg.qr(structure.normal(size=(num_features, num_features)))
    scales = structure.uniform(0.5, 20.0, size=num_features)
    offsets = structure.uniform(-50.0, 50.0, size=num_features)
    labels = rng.integers(0, num_classes, size=num_rows)
    features = (centroids[labels] + rng.normal(0.0, noise, size=(num_rows, num_features))) @ rotation
    features = features * scales + offsets
    columns = {"row_id": pa.array(np.arange(first_key, first_key + num_rows, dtype=np.int64))}
    dirty = rng.random(num_rows) < dirty_fraction if dirty_fraction > 0 else None
    for index in range(num_features):
        column = features[:, index]
        mask = dirty if (dirty is not None and index == 0) else None
        columns[f"f_{index:03d}"] = pa.array(column, mask=mask)
    columns["label"] = pa.array(labels.astype(np.int64))
    return pa.table(columns)


def write_synthetic(out_uri: str, num_rows: int, num_features: int = 32, num_classes: int = 10,
                    num_shards: int = 8, seed: int = 0, dirty_fraction: float = 0.001, noise: float = 1.1) -> list[str]:
    """Synthetic raw shards, generated one shard at a time so memory stays bounded."""
    storage.makedirs(out_uri)
    bounds = np.linspace(0, num_rows, num_shards + 1).astype(int)
    uris = []
    for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        table = synthetic_table(stop - start, num_features, num_classes, seed=seed * 100003 + index,
                                dirty_fraction=dirty_fraction, first_key=int(start), noise=noise)
        uri = storage.join(out_uri, f"part-{index:05d}.parquet")
        fs, path = storage.filesystem(uri)
        with fs.open(path, "wb") as handle:
            pq.write_table(table, handle)
        uris.append(uri)
    log.info("wrote %d synthetic rows (%d features, %d classes) in %d shards to %s",
             num_rows, num_features, num_classes, num_shards, out_uri)
    return uris


def imbalanced_table(num_rows: int, *, positive_fraction: float = 0.03, num_features: int = 8, seed: int = 0) -> pa.Table:
    """A binary fraud-like table: about ``positive_fraction`` positives (label 1), whose features are shifted along a
    few directions, so the classes overlap (no model is perfect) and accuracy says little (always 0 scores 0.97)."""
    rng = np.random.default_rng(seed)
    labels = (rng.random(num_rows) < positive_fraction).astype(np.int64)
    shift = np.zeros(num_features)
    shift[:3] = (1.6, -1.2, 0.9)
    features = rng.normal(size=(num_rows, num_features)) + labels[:, None] * shift
    columns = {"row_id": pa.array(np.arange(num_rows, dtype=np.int64))}
    for index in range(num_features):
        columns[f"x_{index}"] = pa.array(features[:, index] * (index + 1) + 10 * index)  # scales normalisation fixes
    columns["label"] = pa.array(labels)
    return pa.table(columns)


def write_imbalanced(out_uri: str, num_shards: int = 2, num_rows: int = 8000) -> list[str]:
    """The imbalanced binary data set (:func:`imbalanced_table`, about 3 % positives) as raw shards."""
    uris = _write_shards(out_uri, imbalanced_table(num_rows), num_shards)
    log.info("wrote %d imbalanced rows in %d shards to %s", num_rows, num_shards, out_uri)
    return uris


# Token ids start far above 2^53, where float64 (let alone float32) cannot hold them exactly: only int64 keeps them.
TOKEN_ID_BASE = 2**60
SIGNAL_TOKENS = 8
CHANNELS = ("web", "app", "mail", "store")


def tokens_table(num_rows: int, *, vocabulary: int = 64, max_length: int = 16, seed: int = 0, first_key: int = 0) -> pa.Table:
    """Variable-length token sequences (2..max_length ids, each ``TOKEN_ID_BASE + i``), a categorical ``channel`` and
    a float ``hour``; ``label`` is 1 when a sequence holds one of the first ``SIGNAL_TOKENS`` ids, balanced."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, max_length + 1, size=num_rows)
    labels = rng.integers(0, 2, size=num_rows)
    ids = rng.integers(SIGNAL_TOKENS, vocabulary, size=int(lengths.sum()))
    starts = np.cumsum(lengths) - lengths
    signal_at = starts + rng.integers(0, lengths)  # one place in each positive row holds a signal token
    ids[signal_at[labels == 1]] = rng.integers(0, SIGNAL_TOKENS, size=int(labels.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids.astype(np.int64) + TOKEN_ID_BASE))
    return pa.table({"row_id": pa.array(np.arange(first_key, first_key + num_rows, dtype=np.int64)), "tokens": tokens,
                     "channel": pa.array(rng.choice(CHANNELS, size=num_rows)),
                     "hour": pa.array(rng.uniform(0, 24, size=num_rows)), "label": pa.array(labels.astype(np.int64))})


def write_tokens(out_uri: str, num_shards: int = 4, num_rows: int = 4000, max_length: int = 16) -> list[str]:
    """The token sequence data set (:func:`tokens_table`) as raw shards."""
    uris = _write_shards(out_uri, tokens_table(num_rows, max_length=max_length), num_shards)
    log.info("wrote %d token rows in %d shards to %s", num_rows, num_shards, out_uri)
    return uris


DEMO_WRITERS = {"tokens": write_tokens, "imbalanced": write_imbalanced, "digits": write_digits,
                "digits-images": write_digits_images, "diabetes": write_diabetes,
                "synthetic": lambda uri, num_shards=8: write_synthetic(uri, 20_000, num_shards=num_shards)}
"""dataset.demo_data -> the writer of that data set: ``writer(out_uri, num_shards)``, each with its own default."""
