"""Data sets: scikit-learn's bundled digits and diabetes, and a synthetic generator of any size.

Run: ``python -m stagewise.data demo`` (the config's dataset.demo_data into its dataset.uri, unless already there)
     ``python -m stagewise.data digits OUT_URI [--num-shards 4]``          (64 columns px_00..px_63)
     ``python -m stagewise.data digits-images OUT_URI [--num-shards 4]``   (one 64-value list column ``image``)
     ``python -m stagewise.data diabetes OUT_URI [--num-shards 2]``        (10 float features, a float ``target``)
     ``python -m stagewise.data synthetic OUT_URI --rows 1000000 [--features 32 --classes 10]``

Each writes raw Parquet shards with an integer row key ``row_id``, a label (an integer class, or the
diabetes' float ``target``) and numeric feature columns: the raw layout the preprocess stage expects.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from stagewise.core import storage
from stagewise.core.cli import setup_logging
from stagewise.core.errors import DataError
from stagewise.datasets.columns import feature_difference, resolve_columns
from stagewise.datasets.demo import DEMO_WRITERS, write_synthetic
from stagewise.definitions.loading import load_config
from stagewise.definitions.pipelines import discover

log = logging.getLogger("stagewise.data")


@dataclass(frozen=True)
class CheckedFile:
    """A source file that passed ingest's checks."""

    uri: str
    sha256: str
    rows: int
    size: int
    features: list[str]


def _check_source(config: Any, uri: str) -> CheckedFile:
    """Read ``uri`` whole (every row group of the declared columns) and hash it; a bad file raises DataError naming it."""
    with storage.open_parquet(uri) as parquet:
        columns = resolve_columns(config.dataset, parquet.schema_arrow, uri)
        rows = parquet.metadata.num_rows
        for _ in storage.iter_batches(parquet, [columns.key, columns.label, *columns.raw], 65_536, uri=uri):
            pass  # decoding every page is the check: a corrupt page fails here, before anything is copied
    fs, path = storage.filesystem(uri)
    return CheckedFile(uri=uri, sha256=storage.sha256_of(uri), rows=rows, size=fs.size(path), features=columns.features)


def _existing_copy(checked: CheckedFile, target_sizes: dict[str, int], target_name: str) -> str | None:
    """The data-set file that already holds ``checked``'s bytes, if any (same size first: hashing is the rare case)."""
    for uri, size in target_sizes.items():
        if uri.rsplit("/", 1)[-1] == target_name:
            return uri  # content-addressed: the name is the hash
        if size == checked.size and storage.sha256_of(uri) == checked.sha256:
            return uri
    return None


def ingest(config: Any, source_uri: str, target_uri: str) -> dict[str, Any]:
    """Add the source's Parquet files to the data set: all of them or none, never a file twice.

    Every source file is checked first (readable Parquet, every page decodes, the data set's
    schema and the same feature columns as the data set) and nothing is written unless all pass.
    Copies are named by content and each appears whole (written aside, then renamed), so a retry
    after a crash skips what an earlier attempt finished and adds exactly the rest.
    """
    storage.require_bucket(target_uri, "dataset.uri")
    storage.require_bucket(source_uri, "source_uri")
    sources = storage.list_parquet(source_uri)
    checked = [_check_source(config, uri) for uri in sources]
    by_digest: dict[str, CheckedFile] = {}
    for item in checked:
        twin = by_digest.setdefault(item.sha256, item)
        if twin is not item:
            raise DataError(f"{item.uri} and {twin.uri} have identical bytes: ingesting both would duplicate every row "
                            f"(dataset.key must be unique); remove one")
    fs, path = storage.filesystem(target_uri)
    target_files = storage.list_parquet(target_uri) if fs.isdir(path) and fs.glob(path.rstrip("/") + "/**/*.parquet") else []
    target_sizes = {uri: fs.size(storage.filesystem(uri)[1]) for uri in target_files}
    reference_uri = target_files[0] if target_files else checked[0].uri
    reference = (resolve_columns(config.dataset, storage.read_schema(reference_uri), reference_uri).features
                 if target_files else checked[0].features)
    for item in checked:
        difference = feature_difference(item.uri, item.features, reference_uri, reference)
        if difference:
            raise DataError(difference)

    added, present, rows = [], [], 0
    for item in checked:
        name = f"part-ingest-{item.sha256[:16]}.parquet"
        destination = storage.join(target_uri, name)
        existing = _existing_copy(item, target_sizes, name) or (destination if storage.exists(destination) else None)
        if existing:
            present.append(existing)  # an earlier attempt or run already added these bytes
            continue
        storage.copy_atomic(item.uri, destination, expected_sha256=item.sha256)
        added.append(destination)
        rows += item.rows
    log.info("ingested %d new file(s), %d rows, into %s; %d file(s) were already there", len(added), rows, target_uri,
             len(present))
    return {"added": added, "already_present": present, "rows": rows, "target": target_uri}




def write_demo(num_shards: int | None = None, config_file: str | None = None) -> str:
    """Write the data set the pipeline config asks for (dataset.demo_data) where its dataset.uri points, once,
    in ``num_shards`` files (default: that data set's own), never fewer than its widest training stage's processes."""
    import inspect

    config = load_config(config_file)
    target = storage.resolve(config.storage_root, config.dataset.uri)
    fs, path = storage.filesystem(target)
    if fs.isdir(path) and fs.glob(path.rstrip("/") + "/*.parquet"):
        log.info("demo data already at %s", target)
    else:
        writer = DEMO_WRITERS[config.dataset.demo_data]
        asked = num_shards if num_shards is not None else inspect.signature(writer).parameters["num_shards"].default
        widest = max(config.train.stages, key=lambda stage: config.profiles[stage.profile].world_size)
        processes = config.profiles[widest.profile].world_size
        if asked < processes:  # every rank of a stage reads its own files: fewer fail the stage, not the data step
            log.warning("%d shard(s) are fewer than stage %s's %d processes: writing %d", asked, widest.name, processes,
                        processes)
        writer(target, num_shards=max(asked, processes))
    return target


def write_all_demos(num_shards: int | None = None) -> None:
    """write_demo for every pipeline of the deployment (``make up``). A pipeline whose storage is remote (s3://) and
    cannot be written from here (no credentials in this shell: its workers use its storage_conn_id) is named and
    skipped, so one such pipeline stops no other's demo data nor the local Airflow from starting."""
    for pipeline in discover():
        config = load_config(pipeline.path)
        target = storage.resolve(config.storage_root, config.dataset.uri)
        if "://" not in target or target.startswith("file://"):
            write_demo(num_shards, str(pipeline.path))
            continue
        try:
            write_demo(num_shards, str(pipeline.path))
        except Exception as exc:  # noqa: BLE001 - any failure to reach that storage is this pipeline's alone
            log.warning("pipeline %s: no demo data written to its %s storage (%s): this shell cannot reach it; "
                        "write it with that storage's credentials (STAGEWISE_CONFIG=%s python -m stagewise.data demo) "
                        "or add data through its %s_ingest DAG", pipeline.name, target.split("://", 1)[0],
                        type(exc).__name__, pipeline.path, pipeline.name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    for name, text, shards in (("digits", "scikit-learn's bundled handwritten digits, a column per pixel", 4),
                               ("digits-images", "the digits with each image in one 64-value list column 'image'", 4),
                               ("diabetes", "scikit-learn's bundled diabetes regression set (float target)", 2)):
        bundled = sub.add_parser(name, help=text)
        bundled.add_argument("out_uri")
        bundled.add_argument("--num-shards", type=int, default=shards)
    demo = sub.add_parser("demo", help="dataset.demo_data into the pipeline config's dataset.uri unless it already holds shards")
    demo.add_argument("--num-shards", type=int, default=None, help="files to split it into (default: the data set's own); "
                      "never fewer than the widest training stage's processes")
    demo.add_argument("--all", action="store_true", help="for every pipeline of the deployment ($STAGEWISE_PIPELINES)")
    demo.add_argument("--config", default=None, help="pipeline YAML (default: $STAGEWISE_CONFIG or pipeline.yaml)")
    synth = sub.add_parser("synthetic", help="a learnable synthetic classification set")
    synth.add_argument("out_uri")
    synth.add_argument("--rows", type=int, required=True)
    synth.add_argument("--features", type=int, default=32)
    synth.add_argument("--classes", type=int, default=10)
    synth.add_argument("--num-shards", type=int, default=8)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--dirty-fraction", type=float, default=0.001)
    args = parser.parse_args(argv)
    setup_logging()
    if args.kind == "demo":
        if args.all and args.config:
            parser.error("demo: give --all (every pipeline) or --config FILE (one), not both")
        if args.all:
            write_all_demos(args.num_shards)
        else:
            write_demo(args.num_shards, args.config)
    elif args.kind == "synthetic":
        write_synthetic(args.out_uri, args.rows, args.features, args.classes, args.num_shards, args.seed, args.dirty_fraction)
    else:
        DEMO_WRITERS[args.kind](args.out_uri, args.num_shards)


if __name__ == "__main__":
    main()
