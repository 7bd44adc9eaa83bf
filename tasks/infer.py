"""Sharded batch inference: plan shards by file and row-group ranges, score each, commit a manifest.

Run:  ``python -m stagewise.infer plan --input raw/digits`` (a shard is a list of files: stagewise.datasets.sharding)
      ``python -m stagewise.infer shard --model M --shard '{"index": 0, "uri": "...", "row_groups": [0]}' --out P``
      ``python -m stagewise.infer commit --out P --model M --results @results.json``

Each shard streams its row groups in batches, so memory is bounded by the batch size (times a few chunks in
flight). Scoring is a pipeline of threads, so the model waits on neither storage nor the host: a reader thread
fetches the next row groups (:func:`read_ahead`), preparing threads turn them into chunks of rows
(:func:`ordered_map`; numpy and pyarrow release the GIL), the model scores on the profile's device in the calling
thread, and a writer thread converts and writes the outputs (:class:`SerialWriter`), coalesced into row groups of
at least 65,536 rows and dictionary-encoded only where values repeat.

One writer thread is the bound of a large shard (Parquet encoding is one thread per file), so a shard of at least
2 x ``OUTPUT_FILE_ROWS`` rows is cut at row-group boundaries into up to ``max(2, threads_per_process)`` (at most 8)
contiguous parts of about equal rows (:func:`output_parts`), each with its own reader, preparing threads, writer
thread and output file; the model takes a chunk of each part in turn (:func:`interleave`). A smaller shard keeps one
file. The parts depend only on the shard and the profile, never on the machine or the threads' timing, and every
stage keeps the order of the rows, so the shard's files, read in the order its result (and the manifest) lists
them, hold the same rows in the same order, with the same predictions and quarantine, as scoring one chunk after
another; a re-run writes the same bytes. Raw rows become
the model's inputs as in preprocessing (tensor columns flattened by the same function, the bundle's
normalisation). Output rows carry the key, the spec's prediction columns (e.g. the class and its
probabilities, or a regressor's float value) and the model version. Shard files
are attempt-unique; only ``predictions/manifest.json``, written last, makes them visible, all of a shard's files
together (a shard's result lists them under ``files`` and its quarantine files under ``quarantine_files``; ``uri``
and ``quarantine_uri`` name the first of each, as before).

The inference profile's ``device`` picks where the model runs (cpu; cuda; auto = cuda when present).
On CUDA each chunk of rows is normalised straight into pinned host memory and copied on a side stream
while the previous chunk scores (:func:`prefetch`); outputs come back once per chunk. TF32 is off while
scoring, so a shard's probabilities on a GPU agree with the CPU's to within 1e-5 (tests/tasks/test_infer_cuda.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from stagewise.core.cli import common_parser, help_before_imports, json_arg, parse_overrides, run_subjob


def build_parser() -> argparse.ArgumentParser:
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
    return parser


# --help answers before the imports below, which load torch (seconds); they follow code on purpose
# ruff: noqa: E402
if __name__ == "__main__":
    help_before_imports(build_parser)

from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.datasets import predictions, sharding
from stagewise.datasets.columns import (
    check_feature_types,
    check_typed_types,
    check_unique_columns,
    flatten_features,
    layout_of,
)
from stagewise.datasets.typed import fill_categories, typed_block, write_typed_slots
from stagewise.definitions.config import PipelineConfig
from stagewise.definitions.loading import load_config
from stagewise.definitions.spec import batch_of, user_hook
from stagewise.models import scoring
from stagewise.models.bundle import load_bundle
from stagewise.models.scoring import SerialWriter, exact_float32, ordered_map, prefetch, read_ahead, scoring_device

log = logging.getLogger("stagewise.infer")

# Output row groups hold at least this many rows: a chunk each (batch_size defaults to 1024) made many small groups,
# slower to write and to read; the rows and their order are unchanged.
OUTPUT_ROW_GROUP_ROWS = 65_536
READ_AHEAD_BATCHES = 4  # batches the reader thread keeps ready (a row group is read whole, then cut)
WRITES_IN_FLIGHT = 4  # scored chunks waiting for a writer thread before the model waits
# A shard is split into several output files (written in parallel) only from twice this many rows, and into no more
# files than leaves each about this many: no tiny files.
OUTPUT_FILE_ROWS = 262_144
MAX_OUTPUT_FILES = 8


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

    with torch.no_grad(), user_hook(bundle.spec, module=bundle.module, context="on one probe row of zeros"):
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


def _numbered(batches: Iterable[Any], offset: int = 0, source: str = "") -> Iterator[tuple[Any, int, str]]:
    """Each batch with the shard row of its first row in its file (quarantine and errors name rows by it) and that
    file; ``offset``: the shard row of the first batch's first row."""
    for batch in batches:
        yield batch, offset, source
        offset += batch.num_rows


def _part_batches(uris: list[str], units: list[tuple[int, int]], offsets: list[int], columns: list[str],
                  batch_size: int) -> Iterator[tuple[Any, int, str]]:
    """The batches of a part's (file, row group) units in order, each file's consecutive groups read as one run
    through a handle of its own, closed before the next file opens (a shard may hold thousands of small files)."""
    start = 0
    while start < len(units):
        k = units[start][0]
        stop = start
        while stop < len(units) and units[stop][0] == k:
            stop += 1
        with storage.open_parquet(uris[k]) as parquet:
            yield from _numbered(storage.iter_batches(parquet, columns, batch_size, [g for _, g in units[start:stop]],
                                                      uri=uris[k]), offsets[start], uris[k])
        start = stop


def _host_chunk(item: tuple[Any, int, str], key: str, layout: Any, prep: dict[str, Any], pin: bool, bad_rows: str) -> tuple[tuple[Any, int], Any, Any]:
    """One Parquet batch (with its first row's place in the shard's part of its file, and that file) as ((keys of the scorable rows, rows read),
    their records: normalised float32 features and the typed columns' slots encoded as preprocessing did,
    a quarantine table of the unscorable rows with a reason, or None).

    Unscorable rows fail the shard (``bad_rows == 'fail'``) or come back for quarantine. Features are normalised
    in float64 and rounded to float32 as before, written straight into pinned memory when ``pin``, so a CUDA copy
    needs no staging copy of its own. Runs in a worker thread: it touches only its own batch.
    """
    import numpy as np
    import pyarrow as pa
    import torch

    batch, offset, source = item
    features, shapes = prep["features"], prep.get("feature_shapes") or {}
    mean, std = np.asarray(prep["mean"]), np.asarray(prep["std"])
    dense = [column.name for column in layout.columns if not column.typed]
    matrix = flatten_features(batch, dense, shapes, source)
    block = None
    if layout.typed:
        block = typed_block(batch, layout, source)
        fill_categories(block, layout, prep.get("vocabularies") or {})
    keys, rows, bad = batch.column(key), None, None
    # One pass decides the common case: a sum is finite only when every value is (an overflow merely takes the
    # row-by-row path below, which finds no bad row).
    clean = (bool(np.isfinite(matrix.sum())) and keys.null_count == 0
             and (block is None or bool(block.keep.all())))
    if not clean:
        reasons = _row_problems(batch, key, features, matrix)
        if block is not None:
            reasons[(reasons == "") & ~block.keep] = "null or non-finite value in a typed feature column"
        valid = reasons == ""
        if not valid.all():
            first = int(np.flatnonzero(~valid)[0])
            if bad_rows == "fail":
                raise DataError(f"{source}: {int((~valid).sum())} row(s) cannot be scored, first at row "
                                f"{offset + first} (key {keys[first].as_py()!r}): {reasons[first]} "
                                f"(inference.bad_rows=fail)")
            bad = pa.table({key: keys.filter(pa.array(~valid)),
                            "reason": pa.array(list(reasons[~valid]), pa.string()),
                            "source_uri": pa.array([source] * int((~valid).sum()), pa.string()),
                            "source_row": pa.array(offset + np.flatnonzero(~valid), pa.int64())})
            rows, matrix, keys = np.flatnonzero(valid), matrix[valid], keys.filter(pa.array(valid))
    # In place on this chunk's own matrix: the same float64 operations as (matrix - mean) / std.
    np.subtract(matrix, mean, out=matrix)
    np.divide(matrix, std, out=matrix)
    scaled = torch.empty((len(matrix), layout.words), dtype=torch.float32, pin_memory=pin)  # every read word is written
    scaled.numpy()[:, : layout.dense] = matrix  # the same float64 -> float32 rounding as astype
    if block is not None:
        write_typed_slots(scaled.numpy(), block, layout, rows)
    return (keys, batch.num_rows), scaled, bad


def _quarantining(prepared: Iterable[tuple[int, tuple[Any, Any, Any]]],
                  quarantine: Callable[[int, Any], None]) -> Iterator[tuple[tuple[int, Any], Any]]:
    """The chunks of ``prepared`` (each with its part ``k``) as ((k, meta), records), their unscorable rows handed
    to ``quarantine(k, rows)`` in each part's order."""
    for k, (meta, scaled, bad) in prepared:
        if bad is not None:
            quarantine(k, bad)
        yield (k, meta), scaled


def output_parts(group_rows: list[int], writers: int) -> list[range]:
    """The shard's row groups (positions in its list) cut into contiguous parts, one output file each, in order:
    one part below 2 x ``OUTPUT_FILE_ROWS`` rows, else at most ``writers`` parts of about equal rows, about
    ``OUTPUT_FILE_ROWS`` or more each (cut at row-group boundaries; a row group is never split)."""
    total = sum(group_rows)
    count = min(writers, total // OUTPUT_FILE_ROWS, len(group_rows)) if total >= 2 * OUTPUT_FILE_ROWS else 1
    if count <= 1:
        return [range(len(group_rows))]
    parts, start, seen = [], 0, 0
    for position, rows in enumerate(group_rows):
        seen += rows
        if len(parts) < count - 1 and seen * count >= total * (len(parts) + 1):
            parts.append(range(start, position + 1))
            start = position + 1
    parts.append(range(start, len(group_rows)))
    return [part for part in parts if len(part)]


class _PartOutput:
    """One output file of a shard (a contiguous run of its row groups) and, once a row is unscorable, its quarantine
    file. Scored tables are coalesced and written by the part's own writer thread; the quarantine is written by the
    model's thread."""

    def __init__(self, uri: str, quarantine_uri: str, schema: Any, name: str) -> None:
        self.uri, self.quarantine_uri, self.schema = uri, quarantine_uri, schema
        self.rows = self.quarantined = 0
        self.buffered: list[Any] = []  # scored tables not yet written: the writer thread's, then (after finish) ours
        self.output = SerialWriter(WRITES_IN_FLIGHT, name=name)
        self.sink = self.writer = self.quarantine_handle = self.quarantine_writer = None

    def open(self) -> None:
        import pyarrow.parquet as pq

        fs, path = storage.filesystem(self.uri)
        self.sink = fs.open(path, "wb")
        self.writer = pq.ParquetWriter(self.sink, self.schema, use_dictionary=_dictionary_columns(self.schema))

    def quarantine(self, bad: Any) -> None:
        import pyarrow.parquet as pq

        if self.quarantine_writer is None:
            fs, path = storage.filesystem(self.quarantine_uri)
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self.quarantine_handle = fs.open(path, "wb")
            self.quarantine_writer = pq.ParquetWriter(self.quarantine_handle, bad.schema)
        self.quarantine_writer.write_table(bad)
        self.quarantined += len(bad)

    def add(self, table: Any) -> None:  # in the writer thread, in order
        self.buffered.append(table)
        if sum(len(t) for t in self.buffered) >= OUTPUT_ROW_GROUP_ROWS:
            self.flush()
        self.rows += len(table)

    def flush(self) -> None:
        import pyarrow as pa

        if self.buffered:
            self.writer.write_table(pa.concat_tables(self.buffered))
            self.buffered.clear()

    def close(self) -> None:
        """Join the writer thread first (nothing writes to the files afterwards), then close them; always."""
        self.output.close()
        for closing in (self.writer, self.sink, self.quarantine_writer, self.quarantine_handle):
            if closing is not None:
                closing.close()


def _dictionary_columns(schema: Any) -> list[str]:
    """The output columns worth a Parquet dictionary: the model version and integer or boolean scalar predictions (a
    class). Keys and float values rarely repeat: a dictionary there is built, then abandoned, for every row group
    (measured: 3.7x the write time of plain encoding on 2M rows of probabilities)."""
    import pyarrow as pa

    return [field.name for field in schema
            if field.name == "model_version" or (field.name != schema.names[0]
                                                 and (pa.types.is_integer(field.type) or pa.types.is_boolean(field.type)))]


def _close_all(parts: list[_PartOutput]) -> None:
    """Close every part, even when one fails to; then raise the first error."""
    errors = []
    for part in parts:
        try:
            part.close()
        except Exception as exc:  # noqa: BLE001 - the others still close; raised below
            errors.append(exc)
    if errors:
        raise errors[0]


def score_shard(config: PipelineConfig, model_uri: str, shard: dict[str, Any], out: str) -> dict[str, Any]:
    """Score one shard into attempt-unique Parquet file(s) on the inference profile's device; bad rows fail or go to
    quarantine with a reason. Reading, host preparation, the model and writing overlap, and a large shard is written
    as several files in parallel (module docstring)."""
    import pyarrow as pa
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
    started = time.monotonic()
    parts: list[_PartOutput] = []

    def write(part: _PartOutput, meta: tuple[Any, int], predicted: dict[str, Any], ready: Any) -> None:
        # In the part's writer thread, in the part's order.
        if ready is not None:
            ready.synchronize()  # this chunk's outputs have reached host memory
        keys = meta[0]
        scored = {key: keys}
        with torch.inference_mode():
            for field in output_schema:
                if field.name in predicted:
                    scored[field.name] = _to_arrow(predicted[field.name], field.type)
        scored["model_version"] = pa.repeat(pa.scalar(version, pa.string()), len(keys))
        part.add(pa.table(scored, schema=output_schema))
        rows = sum(p.rows for p in parts)
        log.info("shard %d: %d rows scored, %d quarantined, %.0f rows/s", shard["index"], rows,
                 sum(p.quarantined for p in parts), rows / max(time.monotonic() - started, 1e-9))

    files = sharding.shard_files(shard)
    for entry in files:  # every file as its plan pinned it, before a row is read: no output mixes two versions
        sharding.check_pinned(entry)
    with contextlib.ExitStack() as stack:
        uris, key_fields = [entry["uri"] for entry in files], []
        # The shard's (file, row group) units in order; offsets: rows before each unit among its file's units here.
        units, group_rows, offsets = [], [], []
        for k, (entry, uri) in enumerate(zip(files, uris)):
            with storage.open_parquet(uri) as parquet:
                schema, metadata = parquet.schema_arrow, parquet.metadata
            missing = [c for c in [key, *columns] if c not in schema.names]
            if missing:
                raise DataError(f"{uri}: column(s) {missing} the model needs are missing")
            check_unique_columns(schema, [key, *columns], uri)
            check_feature_types(schema, [c.name for c in layout.columns if not c.typed], shapes, uri)
            if layout.typed:
                check_typed_types(schema, layout, uri)
            key_fields.append(schema.field(key))
            if key_fields[-1].type != key_fields[0].type:
                raise DataError(f"{uri}: key column '{key}' is {key_fields[-1].type}, but {uris[0]} has {key_fields[0].type}")
            seen = 0
            for g in (entry["row_groups"] if entry.get("row_groups") is not None else range(metadata.num_row_groups)):
                units.append((k, g))
                group_rows.append(metadata.row_group(g).num_rows)
                offsets.append(seen)
                seen += group_rows[-1]
        output_schema = prediction_columns(bundle, key_fields[0])  # probed on the CPU, before the move
        model = bundle.module.to(device).eval()
        cuts = output_parts(group_rows, max(2, min(MAX_OUTPUT_FILES, profile.threads_per_process)))
        file_names = ([f"part-{shard['index']:05d}-{token}.parquet"] if len(cuts) == 1 else
                      [f"part-{shard['index']:05d}-{token}-{k:02d}.parquet" for k in range(len(cuts))])
        suffixes = [f"{shard['index']}"] if len(cuts) == 1 else [f"{shard['index']}.{k}" for k in range(len(cuts))]
        for file_name, suffix in zip(file_names, suffixes):
            parts.append(_PartOutput(storage.join(out, "predictions", file_name),
                                     storage.join(out, "predictions", "quarantine", file_name),
                                     output_schema, name=f"infer-write-{suffix}"))
        stack.callback(_close_all, parts)  # each part's writer thread joined before its files close
        fs_out, path_out = storage.filesystem(parts[0].uri)
        fs_out.makedirs(path_out.rsplit("/", 1)[0], exist_ok=True)
        for part in parts:
            part.open()
        prepare = functools.partial(_host_chunk, key=key, layout=layout, prep=prep, pin=device.type == "cuda",
                                    bad_rows=config.inference.bad_rows)
        workers = max(1, profile.threads_per_process // len(cuts))  # the preparing threads, shared out among parts
        streams = []
        for cut, suffix in zip(cuts, suffixes):
            # Each part reads through its own handles: a ParquetFile is not shared between reader threads.
            batches = read_ahead(_part_batches(uris, [units[i] for i in cut], [offsets[i] for i in cut],
                                               [key, *columns], config.inference.batch_size),
                                 READ_AHEAD_BATCHES, name=f"infer-read-{suffix}")
            streams.append(ordered_map(prepare, batches, workers, name=f"infer-prepare-{suffix}"))
            stack.callback(streams[-1].close)  # on any exit: its threads stop and are joined (before the writers')

        def quarantine(k: int, bad: Any) -> None:
            parts[k].quarantine(bad)

        # The user's batch, forward and predict raise as a user error naming the hook, file and line (no retry).
        guard = user_hook(bundle.spec, module=model)
        with exact_float32(device), torch.inference_mode():
            for (k, meta), inputs in prefetch(_quarantining(scoring.interleave(streams), quarantine), device):
                labels = torch.zeros(len(inputs), dtype=torch.int64, device=device)
                with guard:
                    predicted = bundle.spec.predict(model(batch_of(bundle.spec, inputs, labels)[0]))
                # One copy back per column and chunk; on CUDA it is queued, and the writer thread waits for it.
                host = {name: tensor.to("cpu", non_blocking=True) for name, tensor in predicted.items()}
                ready = None
                if device.type == "cuda":
                    ready = torch.cuda.Event()
                    ready.record()
                parts[k].output.submit(write, parts[k], meta, host, ready)
        for part in parts:
            part.output.finish()
            part.flush()
    rows, bad = sum(part.rows for part in parts), sum(part.quarantined for part in parts)
    result = {"index": shard["index"], "uri": parts[0].uri, "rows": rows, "rows_quarantined": bad,
              "files": [{"uri": part.uri, "rows": part.rows} for part in parts]}
    if bad:
        quarantined = [{"uri": part.quarantine_uri, "rows": part.quarantined} for part in parts if part.quarantined]
        log.warning("shard %d: %d row(s) quarantined with reasons in %s", shard["index"], bad,
                    ", ".join(q["uri"] for q in quarantined))
        result["quarantine_uri"], result["quarantine_files"] = quarantined[0]["uri"], quarantined
    return result


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

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
