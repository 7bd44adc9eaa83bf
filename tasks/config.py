"""Check a pipeline config: ``python -m stagewise.config [pipeline.yaml]`` (or ``--config pipeline.yaml``, with any
``--override KEY=JSON``, as the other jobs take them) validates a file and prints it resolved;
``python -m stagewise.config --reference`` prints the config reference as Markdown; ``--dag-id KIND`` prints the DAG id
of the file's KIND DAG (``pipeline``: ``ml_pipeline``); ``--pipelines [DIR]`` checks every pipeline of a folder and lists them
(a team's CI: exits non-zero naming each broken or clashing file and key); ``--forget NAME`` retires a deleted pipeline's last valid DAGs;
``--rerun SNAPSHOT --as NAME [--out FILE]`` writes a pipeline config that re-runs a past run (docs/pipelines.md).

The schema lives in ``stagewise.definitions.config``, loading in ``stagewise.definitions.loading``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from stagewise.core.cli import parse_overrides
from stagewise.core.errors import UserError
from stagewise.definitions import reference
from stagewise.definitions.config import ConfigError, PipelineConfig
from stagewise.definitions.hyperparams import BUILTIN_SPEC
from stagewise.definitions.last_valid import LastValid
from stagewise.definitions.loading import check_spec_source, config_path, load_config, read_yaml, scratch_root
from stagewise.definitions.pipelines import (
    KINDS,
    NAME_PATTERN,
    PipelineFile,
    dag_id,
    last_valid,
    name_of,
    resolve,
    sources,
)
from stagewise.definitions.roots import unwritable_problem
from stagewise.models import owners
from stagewise.reporting import lineage


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Validate a pipeline config and print it resolved.")
    parser.add_argument("path", nargs="?", help="pipeline YAML (default: $STAGEWISE_CONFIG or pipeline.yaml)")
    # --config and --override as every other sub-job takes them (stagewise.core.cli.common_parser).
    parser.add_argument("--config", metavar="PATH", help="pipeline YAML, as the other jobs take it (instead of PATH)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=JSON",
                        help="override a config key before it is validated, e.g. sweep.num_trials=4 (repeatable)")
    parser.add_argument("--reference", action="store_true", help="print the config reference as Markdown and exit")
    parser.add_argument("--dag-id", choices=KINDS, help="print the DAG id of this config's DAG of that kind and exit")
    parser.add_argument("--pipelines", nargs="?", const="", metavar="DIR",
                        help="check every pipeline of DIR (folders or files, PATH-style; default $STAGEWISE_PIPELINES): "
                             "list each with its DAG ids, or exit 1 naming each broken or clashing file and key")
    parser.add_argument("--forget", metavar="NAME",
                        help="retire deleted pipeline NAME: its last valid DAGs go at the DAG file's next parse "
                             "(with --pipelines DIR as the DAG file names it)")
    parser.add_argument("--rerun", metavar="SNAPSHOT",
                        help="write a pipeline config that re-runs a past run from its snapshot (runs/<dag_id>/<run_id>/"
                             "config.yaml, a path or URI) under the pipeline name --as, so its DAG ids and registry "
                             "name clash with no other's; notes what code changed since the run started")
    parser.add_argument("--as", dest="rerun_name", metavar="NAME", help="--rerun: the new pipeline's name")
    parser.add_argument("--model-name", help="--rerun: the new pipeline's registry.model_name (default: NAME, a "
                                             "registry of its own: its gate never moves the original's model)")
    parser.add_argument("--out", metavar="FILE", help="--rerun: write the config to FILE (NAME.yaml in the "
                                                      "pipelines folder; never overwritten) instead of stdout")
    args = parser.parse_args(argv)
    if args.config and args.path and args.config != args.path:
        parser.error(f"two configs: {args.path} and --config {args.config}; give one")
    args.path = args.path or args.config
    if args.override and (args.reference or args.rerun or args.dag_id or args.forget or args.pipelines is not None):
        parser.error("--override applies to checking one config (PATH or --config) only")
    if args.reference:
        print(reference.markdown())
        return
    if args.rerun and not args.rerun_name:
        parser.error("--rerun needs --as NAME: the re-run's pipeline name, other than the original's")
    try:
        if args.rerun:
            _write_rerun(args.rerun, args.rerun_name, args.model_name, args.out)
            return
        if args.dag_id:
            print(dag_id(name_of(config_path(args.path)), args.dag_id))
            return
        if args.forget:
            forgotten = LastValid(sources(args.pipelines or None)).forget(args.forget)
            print(f"{args.forget}: {'retired' if forgotten else 'no last valid version kept'}")
            return
        if args.pipelines is not None:
            check(args.pipelines or None)
            return
    except UserError as exc:  # a ConfigError; a DataError: a torn lineage.json or snapshot of the run to re-run
        raise SystemExit(str(exc)) from None
    except FileExistsError:
        raise SystemExit(f"{args.out} exists: give --out a new file") from None
    except OSError as exc:  # --out in a folder that is not there, or not writable
        raise SystemExit(f"--out {args.out}: cannot write it ({exc.strerror or exc}): give a file in a folder that "
                         f"exists and you may write") from None
    try:
        overrides = parse_overrides(args.override)
        config = load_config(args.path, overrides)
        check_spec_source(config_path(args.path), config, may_import=True)  # installed packages' specs too
        _check_objective_reported(config_path(args.path), config)
        _check_relative_root_writable(config_path(args.path), config, overrides)
    except UserError as exc:  # a ConfigError, or an --override that is no KEY=VALUE
        raise SystemExit(str(exc)) from None
    print(yaml.safe_dump(config.model_dump(), sort_keys=False))


def _check_objective_reported(resolved: object, config: PipelineConfig) -> None:
    """A user's spec that keeps a Classifier's or Regressor's metrics() reports their built-in metrics (narrowed by
    model.args.metrics) and loss: objective.metric must be one of them, named with the rest. A spec with metrics of its
    own is checked on the first training batch instead; the schema knows the built-in spec's already."""
    if config.model.spec == BUILTIN_SPEC:
        return
    module, _, name = config.model.spec.partition(":")
    try:
        spec_class = getattr(importlib.import_module(module), name, None)  # the user's module: it imports torch itself
    except ImportError:
        return  # named by check_spec_source already, or left to the first stage
    metrics = getattr(spec_class, "metrics", None)
    if getattr(metrics, "__module__", None) != "stagewise.definitions.spec" or \
            getattr(metrics, "__qualname__", None) not in ("Classifier.metrics", "Regressor.metrics"):
        return
    names = config.model.args.get("metrics") or spec_class.metric_names
    reported = sorted({*names, "loss"})
    if config.objective.metric not in reported:
        raise ConfigError(f"{resolved}: objective.metric: '{config.objective.metric}' is not a metric "
                          f"{config.model.spec} reports; it reports {', '.join(reported)}")


def _check_relative_root_writable(resolved: object, config: PipelineConfig, overrides: dict) -> None:
    """A relative storage_root lands beside the config, on this machine: the check probes it as the first task will
    write it (an absolute root may be another host's, so it is left to the run)."""
    if not isinstance(resolved, Path) or scratch_root():
        return
    written = overrides.get("storage_root", read_yaml(resolved.read_text(), resolved).get("storage_root"))
    if not isinstance(written, str) or "://" in written or os.path.isabs(written):
        return
    if problem := unwritable_problem(Path(config.storage_root)):
        raise ConfigError(f"{resolved}: storage_root '{written}' is relative to the config's folder, so runs write "
                          f"runs/, models/ and raw/ under {config.storage_root}; but {problem}, so the first task would "
                          f"fail writing there: set storage_root to an absolute folder this user may write (e.g. "
                          f"/data/stagewise) or an s3:// URI, or copy the config to a folder of your own")


def check(setting: str | None) -> None:
    """List the pipelines of ``setting``; any error (each file and key, clashes included) exits 1. Judged as the
    deployment judges them: a contested registry name stays with the pipeline the registry's owner record names
    (stagewise.models.owners), and on the deployment's host its last valid versions count too (a deleted pipeline, a
    rename); elsewhere (a team's CI) it is a fresh deployment: of two clashing files the newer one is refused."""
    resolved = resolve(setting, state=last_valid(setting), owner_of=owners.read)
    for pipeline in resolved.configs:
        print(_pipeline_line(pipeline))
    if resolved.errors:
        raise SystemExit("\n".join(resolved.errors.values()))


def rerun(snapshot: str, name: str, model_name: str | None = None) -> tuple[str, list[str]]:
    """A pipeline config (YAML) that re-runs the run whose config snapshot is ``snapshot``, and notes on what differs.

    The snapshot holds every value the run used (the trigger form's included, paths absolute) and its pipeline's name,
    so placed in the pipelines folder as it is, it clashes with the pipeline it came from (one name, one registry
    name). Here it becomes pipeline ``name`` with registry ``model_name`` (default ``name``: a registry of its own,
    whose gate never judges against nor moves the original's model); storage, data and the rest stay the run's.
    The snapshot names the user's code by path only: the notes say what changed since the run started (lineage.json).
    """
    if not NAME_PATTERN.fullmatch(name):
        raise ConfigError(f"--as '{name}' cannot name DAGs: a letter, then letters, digits or _ (64 at most)")
    source = config_path(snapshot)
    config = load_config(source)
    if name == config.name:
        raise ConfigError(f"--as '{name}' is the name of the pipeline the run came from: give the re-run another")
    values = config.model_dump(mode="json")
    values["name"] = name
    values["registry"]["model_name"] = model_name or name
    try:
        PipelineConfig.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(f"--model-name: {exc.errors()[0]['msg']}") from None
    folder = str(Path(source).parent) if isinstance(source, Path) else source.rsplit("/", 1)[0]
    notes = _code_changes(config, folder)
    header = [f"# A re-run of {source} as pipeline '{name}' (python -m stagewise.config --rerun): the run's values, its",
              f"# storage and data; DAGs {', '.join(dag_id(name, kind) for kind in KINDS)}; registry model "
              f"'{values['registry']['model_name']}'.", *(f"# note: {_comment_text(note)}" for note in notes)]
    return "\n".join(header) + "\n" + yaml.safe_dump(values, sort_keys=False), notes


def _comment_text(text: str) -> str:
    """``text`` fit for one YAML comment line: a newline or other control character (a path in a forged lineage.json)
    is written escaped, never as a line of its own that YAML would read as keys."""
    return "".join(char if char.isprintable() else char.encode("unicode_escape").decode() for char in text)


def _write_rerun(snapshot: str, name: str, model_name: str | None, out: str | None) -> None:
    text, notes = rerun(snapshot, name, model_name)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if not out:
        print(text, end="")
        return
    with open(out, "x") as handle:  # "x": an existing pipeline is never overwritten
        handle.write(text)
    print(f"wrote {out}: pipeline {name}, DAGs {', '.join(dag_id(name, kind) for kind in KINDS)}", file=sys.stderr)


def _code_changes(config: PipelineConfig, folder: str) -> list[str]:
    """What differs between the code the run at ``folder`` started with (its lineage.json) and the code here now."""
    recorded = lineage.read(folder)
    if recorded is None:
        return [f"{folder} records no code (the run began before runs recorded it): the re-run runs the code as it is now"]
    now = lineage.record(config)
    notes = []
    if recorded.get("stagewise_version") != now["stagewise_version"]:
        notes.append(f"the run started with Stagewise {recorded.get('stagewise_version')}; this is {now['stagewise_version']}")
    then, current = recorded.get("source_fingerprints") or {}, now["source_fingerprints"]
    for path in sorted(then.keys() | current.keys()):
        if path not in current:
            notes.append(f"{path}: part of the run's code, gone from it now (deleted, moved or no longer imported)")
        elif path not in then:
            notes.append(f"{path}: new since the run started")
        elif then[path] != current[path]:
            notes.append(f"{path}: changed since the run started")
    return notes


def _pipeline_line(pipeline: PipelineFile) -> str:
    return f"{pipeline.name}\t{pipeline.path}\t{' '.join(pipeline.dag_ids().values())}"


if __name__ == "__main__":
    main()
