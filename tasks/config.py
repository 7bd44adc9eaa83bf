"""Check a pipeline config: ``python -m stagewise.config [pipeline.yaml]`` validates a file and prints it resolved;
``python -m stagewise.config --reference`` prints the config reference as Markdown; ``--dag-id KIND`` prints the DAG id
of the file's KIND DAG (``pipeline``: ``ml_pipeline``); ``--pipelines [DIR]`` checks every pipeline of a folder and lists them
(a team's CI: exits non-zero naming each broken or clashing file and key); ``--forget NAME`` retires a deleted pipeline's last valid DAGs.

The schema lives in ``stagewise.definitions.config``, loading in ``stagewise.definitions.loading``.
"""

from __future__ import annotations

import argparse

import yaml

from stagewise.definitions import reference
from stagewise.definitions.config import ConfigError
from stagewise.definitions.last_valid import LastValid
from stagewise.definitions.loading import config_path, load_config
from stagewise.definitions.pipelines import KINDS, PipelineFile, dag_id, name_of, resolve, sources


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Validate a pipeline config and print it resolved.")
    parser.add_argument("path", nargs="?", help="pipeline YAML (default: $STAGEWISE_CONFIG or pipeline.yaml)")
    parser.add_argument("--reference", action="store_true", help="print the config reference as Markdown and exit")
    parser.add_argument("--dag-id", choices=KINDS, help="print the DAG id of this config's DAG of that kind and exit")
    parser.add_argument("--pipelines", nargs="?", const="", metavar="DIR",
                        help="check every pipeline of DIR (folders or files, PATH-style; default $STAGEWISE_PIPELINES): "
                             "list each with its DAG ids, or exit 1 naming each broken or clashing file and key")
    parser.add_argument("--forget", metavar="NAME",
                        help="retire deleted pipeline NAME: its last valid DAGs go at the DAG file's next parse "
                             "(with --pipelines DIR as the DAG file names it)")
    args = parser.parse_args(argv)
    if args.reference:
        print(reference.markdown())
        return
    try:
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
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    try:
        config = load_config(args.path)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    print(yaml.safe_dump(config.model_dump(), sort_keys=False))


def check(setting: str | None) -> None:
    """List the pipelines of ``setting``; any error (each file and key, clashes included) exits 1. Checked as a fresh
    deployment sees them: with no last valid version, of two clashing files the newer one is refused."""
    resolved = resolve(setting)
    for pipeline in resolved.configs:
        print(_pipeline_line(pipeline))
    if resolved.errors:
        raise SystemExit("\n".join(resolved.errors.values()))


def _pipeline_line(pipeline: PipelineFile) -> str:
    return f"{pipeline.name}\t{pipeline.path}\t{' '.join(pipeline.dag_ids().values())}"


if __name__ == "__main__":
    main()
