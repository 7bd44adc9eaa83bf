"""Create the Airflow pools the deployment's pipeline configs declare and the deployment does not have yet.

Run: ``python -m stagewise.airflow.pools`` (``make airflow-init`` does, after ``airflow db migrate``).
A pool that already exists is the deployment's: its slots and description are left as they are.
"""

from __future__ import annotations

import argparse
import logging

from stagewise.definitions.loading import load_config
from stagewise.definitions.pipelines import discover

log = logging.getLogger("stagewise.pools")


def ensure_pools(config_file: str | None = None) -> dict[str, str]:
    """Each declared pool's name -> 'created' or 'kept (N slots)': of ``config_file``, else of every pipeline of the
    deployment ($STAGEWISE_PIPELINES; a pool two pipelines declare is created once, as the first declares it)."""
    from airflow.models.pool import Pool

    configs = [load_config(config_file)] if config_file else [load_config(p.path) for p in discover()]
    declared = {}
    for config in configs:
        declared = {**config.pools, **declared}
    outcome = {}
    for name, pool in declared.items():
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
    parser.add_argument("--config", default=None, help="one pipeline YAML (default: every pipeline of the deployment)")
    outcome = ensure_pools(parser.parse_args().config)
    print(f"pools ready: {', '.join(f'{name} {what}' for name, what in sorted(outcome.items())) or '(none declared)'}")


if __name__ == "__main__":
    main()
