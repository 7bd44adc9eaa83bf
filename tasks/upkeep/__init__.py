"""Upkeep of a storage root: what a pipeline's retention policy removes (stagewise.definitions.retention).

Nothing to run here: ``python -m stagewise.retention --config pipeline.yaml [--dry-run]`` is the job, and the
``<name>_maintenance`` DAG runs it. :mod:`.inventory` reads what is stored, :mod:`.policy` decides what goes (a pure
function of the inventory, the policy and the time), :mod:`.removal` removes it and notes it in the runs' reports,
:mod:`.studies` does the same for the Optuna journal.
"""
