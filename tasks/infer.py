"""Sharded batch inference: plan shards by file and row-group ranges, score each, commit a manifest.

Run:  ``python -m stagewise.infer plan --input raw/digits``
      ``python -m stagewise.infer shard --model M --shard '{"index": 0, "uri": "...", "row_groups": [0]}' --out P``
      ``python -m stagewise.infer commit --out P --model M --results @results.json``

Each shard streams its row groups in batches, so memory is bounded by the batch size. Raw rows become
the model's inputs as in preprocessing (tensor columns flattened by the same function, the bundle's
normalisation). Output rows carry the key, the spec's prediction columns (e.g. the class and its
probabilities, or a regressor's float value) and the model version. Shard files
are attempt-unique; only ``predictions/manifest.json``, written last, makes them visible.

The inference profile's ``device`` picks where the model runs (cpu; cuda; auto = cuda when present).
On CUDA each chunk of rows is normalised straight into pinned host memory and copied on a side stream
while the previous chunk scores (:func:`prefetch`); outputs come back once per chunk. TF32 is off while
scoring, so a shard's probabilities on a GPU agree with the CPU's to within 1e-5 (tests/tasks/test_infer_cuda.py).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

from stagewise.core import storage
from stagewise.core.cli import common_parser, json_arg, parse_overrides, run_subjob
from stagewise.core.errors import DataError
from stagewise.datasets import predictions
from stagewise.datasets.columns import check_feature_types, check_typed_types, flatten_features, layout_of
from stagewise.datasets.typed import fill_categories, typed_block, write_typed_slots
from stagewise.definitions.config import PipelineConfig
from stagewise.definitions.loading import load_config
from stagewise.definitions.spec import batch_of
from stagewise.models.bundle import load_bundle
from stagewise.models.scoring import exact_float32, prefetch, scoring_device

log = logging.getLogger("stagewise.infer")


def _row_problems(batch: Any, key: str, features: list[str], matrix: Any) -> Any:
    """Per row: '' when it can be scored, else the reason it cannot."""
    import numpy as np

    reasons = np.full(batch.num_rows, "", dtype=object)
    finite = np.isfinite(matrix)
    for j in np.flatnonzero(~finite.all(axis=0)):  # name the first bad feature of each row
        bad = (~finite[:, j]) & (reasons == "")
        reasons[bad] = f"null or non-finite feature '{features[j]}'"
    null_key = np.asarray(batch.column(key).is_null().to_numpy(zero_copy_only=False))
    reasons[null_key] = "null key"
    return reasons


def _arrow_type(name: str, tensor: Any, spec_path: str) -> Any:
    """The Parquet column type of a prediction column: a scalar per row, or a fixed-size list."""
    import pyarrow as pa
    import torch

    scalar = pa.int64() if not tensor.is_floating_point() and tensor.dtype != torch.bool else (
        pa.bool_() if tensor.dtype == torch.bool else pa.float32())
    if tensor.ndim == 1:
        return scalar
    if tensor.ndim == 2:
        return pa.list_(scalar, tensor.shape[1])
    raise DataError(f"{spec_path}.predict()['{name}'] has shape {tuple(tensor.shape)}: a prediction column must be "
                    f"(rows,) or (rows, k)")


def prediction_columns(bundle: Any, key_field: Any) -> Any:
    """The output schema: the key, the spec's prediction columns (probed on one row of zeros), the model version."""
    import pyarrow as pa
    import torch

    with torch.no_grad():
        layout = bundle.data.layout
        probe_features = layout.probe(1) if layout is not None else torch.zeros(1, bundle.data.num_features)
        probe = bundle.spec.predict(bundle.module(batch_of(bundle.spec, probe_features, torch.zeros(1, dtype=torch.int64))[0]))
    clash = sorted(set(probe) & {key_field.name, "model_version"})
    if clash:
        raise DataError(f"{bundle.ref.path}.predict() names column(s) {clash}, which the output already has")
    return pa.schema([key_field, *(pa.field(name, _arrow_type(name, t, bundle.ref.path)) for name, t in probe.items()),
                      pa.field("model_version", pa.string())])


def _to_arrow(tensor: Any, kind: Any) -> Any:
    import pyarrow as pa

    values = tensor.detach().cpu().numpy()
    if pa.types.is_fixed_size_list(kind):
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), kind.value_type), kind.list_size)
    return pa.array(values, kind)


def _host_chunks(batches: Iterable[Any], key: str, layout: Any, prep: dict[str, Any], pin: bool, source: str,
                 bad_rows: str, quarantine: Any) -> Iterator[tuple[tuple[Any, int], Any]]:
    """Per Parquet batch: ((keys of the scorable rows, rows read), their records: normalised float32 features, and
    the typed columns' slots encoded as preprocessing did).

    Unscorable rows fail the shard (``bad_rows == 'fail'``) or go to ``quarantine(table)`` with a reason.
    Features are normalised in float64 and rounded to float32 as before, written straight into pinned memory
    when ``pin``, so a CUDA copy needs no staging copy of its own.
    """
    import numpy as np
    import pyarrow as pa
    import torch

    features, shapes = prep["features"], prep.get("feature_shapes") or {}
    mean, std = np.asarray(prep["mean"]), np.asarray(prep["std"])
    dense = [column.name for column in layout.columns if not column.typed]
    offset = 0
    for batch in batches:
        matrix = flatten_features(batch, dense, shapes, source)
        reasons = _row_problems(batch, key, features, matrix)
        block = None
        if layout.typed:
            block = typed_block(batch, layout, source)
            fill_categories(block, layout, prep.get("vocabularies") or {})
            reasons[(reasons == "") & ~block.keep] = "null or non-finite value in a typed feature column"
        valid = reasons == ""
        if not valid.all():
            first = int(np.flatnonzero(~valid)[0])
            if bad_rows == "fail":
                raise DataError(f"{source}: {int((~valid).sum())} row(s) cannot be scored, first at row "
                                f"{offset + first} (key {batch.column(key)[first].as_py()!r}): {reasons[first]} "
                                f"(inference.bad_rows=fail)")
            quarantine(pa.table({key: batch.column(key).filter(pa.array(~valid)),
                                 "reason": pa.array(list(reasons[~valid]), pa.string()),
                                 "source_uri": pa.array([source] * int((~valid).sum()), pa.string()),
                                 "source_row": pa.array(offset + np.flatnonzero(~valid), pa.int64())}))
        good = matrix[valid]
        scaled = torch.empty((len(good), layout.words), dtype=torch.float32, pin_memory=pin)  # every read word is written
        scaled.numpy()[:, : layout.dense] = (good - mean) / std  # the same float64 -> float32 rounding as astype
        if block is not None:
            write_typed_slots(scaled.numpy(), block, layout, np.flatnonzero(valid))
        offset += batch.num_rows
        yield (batch.column(key).filter(pa.array(valid)), batch.num_rows), scaled


def score_shard(config: PipelineConfig, model_uri: str, shard: dict[str, Any], out: str) -> dict[str, Any]:
    """Score one shard into an attempt-unique Parquet file on the inference profile's device; bad rows fail or
    go to quarantine with a reason."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    profile = config.profile(config.inference.profile)
    torch.set_num_threads(profile.threads_per_process)
    device = scoring_device(profile.device)
    bundle = load_bundle(model_uri)  # one read: its version, checked against a registered one, then the weights
    version = bundle.version
    prep = bundle.preprocessing
    key, layout = prep["key"], layout_of(prep)
    # Bundles from before tensor columns list only plain feature columns.
    columns, shapes = prep.get("columns") or prep["features"], prep.get("feature_shapes") or {}
    token = storage.unique_token()
    uri = storage.join(out, "predictions", f"part-{shard['index']:05d}-{token}.parquet")
    quarantine_uri = storage.join(out, "predictions", "quarantine", f"part-{shard['index']:05d}-{token}.parquet")
    counts = {"rows": 0, "quarantined": 0}
    started = time.monotonic()
    fs_out, path_out = storage.filesystem(uri)
    fs_out.makedirs(path_out.rsplit("/", 1)[0], exist_ok=True)
    writer = None
    quarantined: dict[str, Any] = {}

    def quarantine(bad: Any) -> None:
        if "writer" not in quarantined:
            fs_q, path_q = storage.filesystem(quarantine_uri)
            fs_q.makedirs(path_q.rsplit("/", 1)[0], exist_ok=True)
            quarantined["handle"] = fs_q.open(path_q, "wb")
            quarantined["writer"] = pq.ParquetWriter(quarantined["handle"], bad.schema)
        quarantined["writer"].write_table(bad)
        counts["quarantined"] += len(bad)

    def write(meta: tuple[Any, int], predicted: dict[str, Any], ready: Any) -> None:
        if ready is not None:
            ready.synchronize()  # this chunk's outputs have reached host memory
        keys = meta[0]
        scored = {key: keys}
        for field in output_schema:
            if field.name in predicted:
                scored[field.name] = _to_arrow(predicted[field.name], field.type)
        scored["model_version"] = pa.repeat(pa.scalar(version, pa.string()), len(keys))
        writer.write_table(pa.table(scored, schema=output_schema))
        counts["rows"] += len(keys)
        log.info("shard %d: %d rows scored, %d quarantined, %.0f rows/s", shard["index"], counts["rows"],
                 counts["quarantined"], counts["rows"] / max(time.monotonic() - started, 1e-9))

    with storage.open_parquet(shard["uri"]) as parquet, fs_out.open(path_out, "wb") as sink:
        names = parquet.schema_arrow.names
        missing = [c for c in [key, *columns] if c not in names]
        if missing:
            raise DataError(f"{shard['uri']}: column(s) {missing} the model needs are missing")
        check_feature_types(parquet.schema_arrow, [c.name for c in layout.columns if not c.typed], shapes, shard["uri"])
        if layout.typed:
            check_typed_types(parquet.schema_arrow, layout, shard["uri"])
        output_schema = prediction_columns(bundle, parquet.schema_arrow.field(key))  # probed on the CPU, before the move
        model = bundle.module.to(device).eval()
        writer = pq.ParquetWriter(sink, output_schema)
        try:
            batches = storage.iter_batches(parquet, [key, *columns], config.inference.batch_size, shard["row_groups"],
                                           uri=shard["uri"])
            chunks = _host_chunks(batches, key, layout, prep, device.type == "cuda", shard["uri"],
                                  config.inference.bad_rows, quarantine)
            pending = None
            with exact_float32(device), torch.inference_mode():
                for meta, inputs in prefetch(chunks, device):
                    labels = torch.zeros(len(inputs), dtype=torch.int64, device=device)
                    predicted = bundle.spec.predict(model(batch_of(bundle.spec, inputs, labels)[0]))
                    # One copy back per column and chunk; on CUDA it is queued, and the previous chunk is written meanwhile.
                    host = {name: tensor.to("cpu", non_blocking=True) for name, tensor in predicted.items()}
                    ready = None
                    if device.type == "cuda":
                        ready = torch.cuda.Event()
                        ready.record()
                    if pending is not None:
                        write(*pending)
                    pending = (meta, host, ready)
                if pending is not None:
                    write(*pending)
        finally:
            writer.close()
            if "writer" in quarantined:
                quarantined["writer"].close()
                quarantined["handle"].close()
    rows, bad = counts["rows"], counts["quarantined"]
    result = {"index": shard["index"], "uri": uri, "rows": rows, "rows_quarantined": bad}
    if bad:
        log.warning("shard %d: %d row(s) quarantined with reasons in %s", shard["index"], bad, quarantine_uri)
        result["quarantine_uri"] = quarantine_uri
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Sharded batch inference steps.")
    common = common_parser()
    sub = parser.add_subparsers(dest="step", required=True)
    p_plan = sub.add_parser("plan", parents=[common])
    p_plan.add_argument("--input", default=None, help="Parquet to score (default: inference.input_uri or dataset.uri)")
    p_shard = sub.add_parser("shard", parents=[common])
    p_shard.add_argument("--shard", type=json_arg, required=True, help="one shard from 'plan' (JSON or @file)")
    p_commit = sub.add_parser("commit", parents=[common])
    p_commit.add_argument("--results", type=json_arg, required=True, help="JSON list of shard results, or @file")
    for p in (p_shard, p_commit):
        p.add_argument("--model", required=True, help="model bundle URI")
        p.add_argument("--out", required=True, help="the run prefix")
    args = parser.parse_args(argv)

    def work() -> dict[str, Any]:
        config = load_config(args.config, parse_overrides(args.override))
        storage.require_bucket(config.storage_root, "storage_root")
        if args.step == "plan":
            source = args.input or config.inference.input_uri or config.dataset.uri
            return {"shards": predictions.plan_inference(storage.resolve(config.storage_root, source), config.inference.rows_per_shard)}
        out = storage.resolve(config.storage_root, args.out)
        if args.step == "shard":
            return score_shard(config, args.model, args.shard, out)
        return predictions.commit_predictions(out, args.model, args.results)

    run_subjob(f"infer {args.step}", work, args.result_file)


if __name__ == "__main__":
    main()
