"""Create or update the Airflow pools the pipeline config declares.

Run: ``python -m stagewise_airflow.pools`` (``make airflow-init`` does, after ``airflow db migrate``).
"""

from __future__ import annotations

import argparse

from tasks.definitions.loading import load_config


def ensure_pools(config_file: str | None = None) -> list[str]:
    from airflow.models.pool import Pool

    config = load_config(config_file)
    for name, pool in config.pools.items():
        Pool.create_or_update_pool(name=name, slots=pool.slots, description=pool.description, include_deferred=False)
    return sorted(config.pools)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="pipeline YAML (default: $STAGEWISE_CONFIG or pipeline.yaml)")
    names = ensure_pools(parser.parse_args().config)
    print(f"pools ready: {', '.join(names) or '(none declared)'}")


if __name__ == "__main__":
    main()
