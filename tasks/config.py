"""Check a pipeline config: ``python -m stagewise.config [pipeline.yaml]`` validates a file and prints it resolved;
``python -m stagewise.config --reference`` prints the config reference as Markdown; ``--dag-id KIND`` prints the DAG id
of the file's KIND DAG (``pipeline``: ``ml_pipeline``); ``--pipelines`` lists the deployment's pipelines.

The schema lives in ``stagewise.definitions.config``, loading in ``stagewise.definitions.loading``.
"""

from __future__ import annotations

import argparse

import yaml

from stagewise.definitions import reference
from stagewise.definitions.config import ConfigError
from stagewise.definitions.loading import config_path, load_config
from stagewise.definitions.pipelines import KINDS, PipelineFile, dag_id, discover, name_of


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Validate a pipeline config and print it resolved.")
    parser.add_argument("path", nargs="?", help="pipeline YAML (default: $STAGEWISE_CONFIG or pipeline.yaml)")
    parser.add_argument("--reference", action="store_true", help="print the config reference as Markdown and exit")
    parser.add_argument("--dag-id", choices=KINDS, help="print the DAG id of this config's DAG of that kind and exit")
    parser.add_argument("--pipelines", action="store_true",
                        help="list every pipeline of the deployment ($STAGEWISE_PIPELINES) with its DAG ids and exit")
    args = parser.parse_args(argv)
    if args.reference:
        print(reference.markdown())
        return
    try:
        if args.dag_id:
            print(dag_id(name_of(config_path(args.path)), args.dag_id))
            return
        if args.pipelines:
            for pipeline in discover():
                print(_pipeline_line(pipeline))
            return
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    try:
        config = load_config(args.path)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    print(yaml.safe_dump(config.model_dump(), sort_keys=False))


def _pipeline_line(pipeline: PipelineFile) -> str:
    return f"{pipeline.name}\t{pipeline.path}\t{' '.join(pipeline.dag_ids().values())}"


if __name__ == "__main__":
    main()
