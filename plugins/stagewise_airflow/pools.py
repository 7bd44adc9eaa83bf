"""Create the Airflow pools the pipeline config declares and the deployment does not have yet.

Run: ``python -m stagewise_airflow.pools`` (``make airflow-init`` does, after ``airflow db migrate``).
A pool that already exists is the deployment's: its slots and description are left as they are.
"""

from __future__ import annotations

import argparse
import logging

from tasks.definitions.loading import load_config

log = logging.getLogger("stagewise.pools")


def ensure_pools(config_file: str | None = None) -> dict[str, str]:
    """Each declared pool's name -> 'created' or 'kept (N slots)'."""
    from airflow.models.pool import Pool

    config = load_config(config_file)
    outcome = {}
    for name, pool in config.pools.items():
        existing = Pool.get_pool(name)
        if existing is None:
            Pool.create_or_update_pool(name=name, slots=pool.slots, description=pool.description, include_deferred=False)
            outcome[name] = "created"
            continue
        outcome[name] = f"kept ({existing.slots} slots)"
        if existing.slots < pool.slots:
            log.warning("pool %s has %d slot(s), fewer than the %d the config declares: profiles asking for more "
                        "pool_slots would never run; its slots are the deployment's to change", name, existing.slots,
                        pool.slots)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="pipeline YAML (default: $STAGEWISE_CONFIG or pipeline.yaml)")
    outcome = ensure_pools(parser.parse_args().config)
    print(f"pools ready: {', '.join(f'{name} {what}' for name, what in sorted(outcome.items())) or '(none declared)'}")


if __name__ == "__main__":
    main()
