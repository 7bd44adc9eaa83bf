"""Typed feature columns (int64 ids, categories, variable-length lists) from raw Parquet to the spec and inference."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from stagewise import infer
from stagewise.core.errors import DataError, UserError
from stagewise.datasets.columns import feature_matrix, layout_of
from stagewise.datasets.demo import TOKEN_ID_BASE, tokens_table
from stagewise.datasets.loader import split_batches
from stagewise.datasets.predictions import plan_inference
from stagewise.models.building import build, data_info
from stagewise.models.bundle import preprocessing_of, save_bundle
from stagewise.spec import Classifier, Features, SpecRef
from stagewise.training.device_data import DeviceBatches
from stagewise.training.distributed import DistEnv
from stagewise.training.loop import start_loop
from tests.tasks.test_preprocess_columns import _config, _processed, _run_all, _write

NUM_ROWS = 400
TOKENS = {"column": "tokens", "dtype": "int64", "max_length": 16}
TYPED_FEATURES = ["hour", TOKENS, {"column": "channel", "dtype": "categorical"}]


def _token_config(write_config, storage_root, features=TYPED_FEATURES, **dataset):
    return _config(write_config, storage_root, {"features": features, "num_classes": 2, **dataset})


@pytest.fixture
def token_run(write_config, storage_root):
    table = tokens_table(NUM_ROWS, seed=1)
    raw_uri = _write(storage_root / "raw" / "t", table)
    config = _token_config(write_config, storage_root)
    out = str(storage_root / "runs" / "r")
    return config, raw_uri, out, table, _run_all(config, raw_uri, out)


def _raw_tokens(table: pa.Table) -> dict[int, list[int]]:
    return dict(zip(table.column("row_id").to_pylist(), table.column("tokens").to_pylist()))


def _decoded_rows(manifest: dict) -> dict[int, list[int]]:
    """Every committed row's key -> its token list as the spec's Features give it back (mask applied)."""
    processed = _processed(manifest)
    features = data_info(manifest).layout.decode(torch.from_numpy(feature_matrix(processed).copy()))
    tokens, mask = features["tokens"], features.mask("tokens")
    return {key: tokens[i][mask[i]].tolist() for i, key in enumerate(processed.column("row_id").to_pylist())}


def test_int64_ids_above_2_to_the_53_reach_the_spec_exactly(token_run):
    """Token ids above 2^60 (which float64, let alone float32, cannot tell apart) come back bit for bit, each row's
    list in its order and length; only rows' padding is added."""
    _, _, _, table, manifest = token_run
    raw, decoded = _raw_tokens(table), _decoded_rows(manifest)
    assert len(decoded) == NUM_ROWS and all(decoded[key] == raw[key] for key in decoded)
    assert min(min(values) for values in decoded.values()) >= TOKEN_ID_BASE


def test_each_batch_is_padded_to_its_own_longest_row_with_a_mask(token_run):
    """features['tokens'] is (rows, longest in this batch) int64; the mask marks the real values, padding is 0, and
    ragged() gives EmbeddingBag's (values, offsets)."""
    _, _, _, table, manifest = token_run
    layout = layout_of(manifest)
    batches = split_batches(manifest, "train", rank=0, world_size=1, batch_size=8, seed=0)
    widths = set()
    for records, _ in batches.epoch(0):
        features = layout.decode(records)
        assert isinstance(features, Features)
        lengths, tokens, mask = features.lengths("tokens"), features["tokens"], features.mask("tokens")
        assert tokens.dtype == torch.int64 and tokens.shape == (8, int(lengths.max()))
        assert torch.equal(mask.sum(1), lengths) and bool((tokens[~mask] == 0).all())
        values, offsets = features.ragged("tokens")
        assert torch.equal(values, tokens[mask]) and offsets.tolist() == [0, *torch.cumsum(lengths, 0)[:-1].tolist()]
        assert features["channel"].shape == (8,) and features.dense.shape == (8, 1)
        widths.add(tokens.shape[1])
    assert len(widths) > 1  # batches differ in width: padding is per batch, not to max_length


def test_a_batch_builds_its_mask_once_and_an_unknown_column_is_named(token_run):
    """A spec that asks for a mask twice gets the same tensor (built once: on a GPU each build is kernel launches);
    a column the data set does not declare fails naming it and the declared ones."""
    _, _, _, _, manifest = token_run
    layout = layout_of(manifest)
    records, _ = next(iter(split_batches(manifest, "train", rank=0, world_size=1, batch_size=8, seed=0).epoch(0)))
    features = layout.decode(records)
    assert features.mask("tokens") is features.mask("tokens")
    with pytest.raises(KeyError, match="no input column 'words'.*'tokens'"):
        features["words"]


@pytest.mark.parametrize("placement", ["resident", "streamed"])
def test_device_placements_carry_the_typed_slots_unchanged(token_run, placement):
    """Resident and streamed device data move whole records: every row's ids decode as the raw rows hold them."""
    _, _, _, table, manifest = token_run
    raw, layout = _raw_tokens(table), layout_of(manifest)
    source = split_batches(manifest, "train", rank=0, world_size=1, batch_size=4, seed=0)
    seen = []
    for records, _ in DeviceBatches(source, "cpu", resident=placement == "resident", chunk_bytes=4096).epoch(1):
        features = layout.decode(records)
        tokens, mask = features["tokens"], features.mask("tokens")
        seen += [tokens[i][mask[i]].tolist() for i in range(len(tokens))]
    assert len(seen) == source.steps_per_epoch(1) * 4
    assert all(row in list(raw.values()) for row in seen[:40])


def test_categories_are_learnt_on_the_training_split_and_unknowns_get_id_0(write_config, storage_root):
    """The vocabulary holds the training split's most frequent values (max_categories of them); any other value
    and a null get id 0, and the spec is told num_categories = vocabulary + 1."""
    table = tokens_table(NUM_ROWS, seed=2)
    channel = np.array(table.column("channel").to_pylist(), dtype=object)
    channel[:3] = None
    table = table.set_column(table.schema.get_field_index("channel"), "channel", pa.array(list(channel), pa.string()))
    raw_uri = _write(storage_root / "raw" / "t", table)
    features = ["hour", TOKENS, {"column": "channel", "dtype": "categorical", "max_categories": 2}]
    manifest = _run_all(_token_config(write_config, storage_root, features), raw_uri, str(storage_root / "runs" / "r"))
    vocabulary = manifest["vocabularies"]["channel"]
    assert len(vocabulary) == 2 and data_info(manifest).input("channel").num_categories == 3
    processed = _processed(manifest)
    ids = data_info(manifest).layout.decode(torch.from_numpy(feature_matrix(processed).copy()))["channel"].tolist()
    by_key = dict(zip(table.column("row_id").to_pylist(), channel))
    for key, got in zip(processed.column("row_id").to_pylist(), ids):
        value = by_key[key]
        assert got == (vocabulary.index(value) + 1 if value in vocabulary else 0)


def test_a_longer_row_fails_naming_the_column_or_is_truncated(write_config, storage_root):
    """A row above max_length is an error naming file, column and length, unless truncate keeps its first values;
    a null id in a list makes the row dirty (dropped and counted), never a silent 0."""
    table = tokens_table(NUM_ROWS, seed=3, max_length=16)
    tokens = table.column("tokens").to_pylist()
    tokens[5] = None
    tokens[6] = [TOKEN_ID_BASE, None]
    table = table.set_column(table.schema.get_field_index("tokens"), "tokens", pa.array(tokens, pa.list_(pa.int64())))
    raw_uri = _write(storage_root / "raw" / "t", table)
    short = [{**TOKENS, "max_length": 8}]
    with pytest.raises(DataError, match=r"feature column 'tokens' has \d+ row\(s\) longer than its max_length 8"):
        _run_all(_token_config(write_config, storage_root, short), raw_uri, str(storage_root / "runs" / "a"))
    manifest = _run_all(_token_config(write_config, storage_root, [{**short[0], "truncate": True}]), raw_uri,
                        str(storage_root / "runs" / "b"))
    assert manifest["rows_dropped"] == 2
    raw, decoded = _raw_tokens(table), _decoded_rows(manifest)
    assert all(decoded[key] == raw[key][:8] for key in decoded)


@pytest.mark.parametrize(("column", "declared", "expected"), [
    ("hour", {"dtype": "int64"}, r"'hour' is declared int64 .* has type double; int64 ids must be stored as integers"),
    ("tokens", {"dtype": "int64"}, r"'tokens' is declared int64 .* a list; give it shape"),
    ("hour", {"dtype": "int64", "max_length": 4}, r"'hour' is declared int64 with max_length 4 .* not a list"),
])
def test_a_typed_column_that_does_not_match_the_data_names_file_column_and_type(write_config, storage_root, column,
                                                                                 declared, expected):
    raw_uri = _write(storage_root / "raw" / "t", tokens_table(40))
    config = _token_config(write_config, storage_root, [{"column": column, **declared}])
    with pytest.raises(DataError, match=expected) as failure:
        _run_all(config, raw_uri, str(storage_root / "runs" / "r"))
    assert "part-00000.parquet" in str(failure.value)


class _EmbeddingOfFirstFeature(Classifier):
    """A user's spec that indexes an embedding with a float feature cast to int: what an id column declared as a
    plain (standardised) float does."""

    def build(self, data, params):
        class Module(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embedding = torch.nn.Embedding(100, 2)

            def forward(self, features):
                return self.embedding(features[:, 0].long())

        return Module()


def test_a_standardised_id_column_used_as_an_index_names_the_column_and_the_normalisation(write_config, storage_root,
                                                                                          monkeypatch):
    """An integer id column left as a standardised float feature fails on the first batch with the column, the
    normalisation and the declaration that fixes it, not only torch's 'index out of range in self'."""
    rng = np.random.default_rng(0)
    table = pa.table({"row_id": np.arange(200), "item": rng.integers(0, 100, 200), "hour": rng.uniform(0, 24, 200),
                      "label": rng.integers(0, 2, 200)})
    raw_uri = _write(storage_root / "raw" / "t", table)
    config = _token_config(write_config, storage_root, ["item", "hour"])
    manifest = _run_all(config, raw_uri, str(storage_root / "runs" / "r"))
    monkeypatch.setattr("stagewise.models.building.SpecRef.load", lambda self: _EmbeddingOfFirstFeature())
    env = DistEnv(rank=0, local_rank=0, world_size=1, device="cpu")
    train = split_batches(manifest, "train", rank=0, world_size=1, batch_size=16, seed=0)
    validation = split_batches(manifest, "validation", rank=0, world_size=1, batch_size=64, seed=0, shuffle=False)
    _, loop = start_loop(config, manifest, env, {"lr": 0.01}, train, validation, seed=0)
    with pytest.raises(UserError) as failure:
        loop.train_epoch(lambda step: 0.01)
    message = str(failure.value)
    assert "index out of range" in message and "['item']" in message and "'hour'" not in message
    assert "standardised" in message and "{column: item, dtype: int64}" in message


def test_inference_encodes_raw_typed_rows_as_preprocessing_did(token_run, storage_root):
    """Scoring raw rows gives, for every key, what the model outputs on that key's processed record: the same ids,
    category ids, padding and normalisation."""
    from stagewise.examples.token_transformer import TokenTransformer

    config, raw_uri, out, _, manifest = token_run
    torch.manual_seed(0)
    spec, data = TokenTransformer(), data_info(manifest)
    params = {**TokenTransformer.default_params, "dim": 8, "heads": 2}
    model = build(spec, data, params).eval()
    model_uri = str(storage_root / "model.pt")
    save_bundle(model_uri, model, SpecRef("stagewise.examples.token_transformer:TokenTransformer"), data, params,
                preprocessing_of(manifest), {})
    scored = pa.concat_tables([pq.read_table(infer.score_shard(config, model_uri, shard, out)["uri"])
                               for shard in plan_inference(raw_uri, 150)])
    processed = _processed(manifest)
    with torch.no_grad():
        records = torch.from_numpy(feature_matrix(processed).copy())
        expected = torch.softmax(model(data.layout.decode(records)), dim=1).numpy()
    by_key = dict(zip(processed.column("row_id").to_pylist(), expected))
    assert scored.num_rows == NUM_ROWS
    got = np.stack(scored.column("probabilities").to_pylist())
    np.testing.assert_allclose(got, np.stack([by_key[k] for k in scored.column("row_id").to_pylist()]), atol=1e-5)


def test_a_stage_runs_the_specs_own_optimizer_and_schedule_over_typed_rows(write_config, storage_root):
    """A training stage over token rows with the example spec's own AdamW groups and its inverse-sqrt schedule
    (the stage's cosine is then not used): each epoch's lr is the spec's factor at that step, and the stage's result
    lists the spec's hyperparameters with the ones given."""
    import json
    from pathlib import Path

    from stagewise.definitions.loading import load_config
    from stagewise.train import run_stage
    from tests.conftest import base_config

    raw_uri = _write(storage_root / "raw" / "t", tokens_table(NUM_ROWS, seed=4))
    raw = base_config(storage_root)
    raw["dataset"] = {"uri": "raw/t", "key": "row_id", "label": "label", "num_classes": 2, "features": TYPED_FEATURES}
    raw["model"] = {"spec": "stagewise.examples.token_transformer:TokenTransformer", "args": {"schedule": "inverse_sqrt"}}
    raw["train"]["stages"] = [{"name": "s1", "profile": raw["train"]["stages"][0]["profile"], "per_process_batch": 32,
                               "epochs": 2, "lr_schedule": {"type": "cosine"}}]
    config = load_config(write_config(raw))
    out = str(storage_root / "runs" / "r")
    _run_all(config, raw_uri, out)
    result = run_stage(config, "s1", out, {"lr": 0.004, "embedding_lr_scale": 0.5}, None)
    history = json.loads((Path(out) / "train" / "s1" / "metrics.json").read_text())["history"]
    for entry in history:
        step = entry["steps"] - 1  # the lr of the epoch's last step
        assert entry["lr"] == pytest.approx(0.004 / (1.0 + step / 10.0) ** 0.5, rel=1e-6)
    assert result["params"]["embedding_lr_scale"] == 0.5 and result["params"]["dim"] == 32
