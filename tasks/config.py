"""Check a pipeline config: ``python -m tasks.config [pipeline.yaml]`` validates a file and prints it resolved;
``python -m tasks.config --reference`` prints the config reference as Markdown.

The schema lives in ``tasks.definitions.config``, loading in ``tasks.definitions.loading``.
"""

from __future__ import annotations

import argparse

import yaml

from tasks.definitions import reference
from tasks.definitions.config import ConfigError
from tasks.definitions.loading import load_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Validate a pipeline config and print it resolved.")
    parser.add_argument("path", nargs="?", help="pipeline YAML (default: $STAGEWISE_CONFIG or pipeline.yaml)")
    parser.add_argument("--reference", action="store_true", help="print the config reference as Markdown and exit")
    args = parser.parse_args(argv)
    if args.reference:
        print(reference.markdown())
        return
    try:
        config = load_config(args.path)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    print(yaml.safe_dump(config.model_dump(), sort_keys=False))


if __name__ == "__main__":
    main()
