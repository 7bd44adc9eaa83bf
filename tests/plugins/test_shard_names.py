"""Mapped shard tasks are named in the grid by their files: a multi-file shard (stagewise.datasets.sharding) by its
first file and how many more, a one-file shard as before; the templates render under Airflow's strict undefined."""

from __future__ import annotations

import types

import jinja2.sandbox

from stagewise.airflow import wiring


def _render(template: str, shard: dict) -> str:
    env = jinja2.sandbox.SandboxedEnvironment(undefined=jinja2.StrictUndefined)
    return env.from_string(template).render(task=types.SimpleNamespace(op_kwargs={"shard": shard}))


def test_shard_names_cover_one_file_several_files_and_shards_planned_before_files():
    one = {"index": 0, "uri": "/raw/p-0.parquet", "row_groups": [0, 1, 2], "rows": 30,
           "files": [{"uri": "/raw/p-0.parquet", "row_groups": [0, 1, 2]}]}
    several = {"index": 1, "rows": 9, "files": [{"uri": "/raw/p-1.parquet", "row_groups": [0]},
                                                {"uri": "/raw/p-2.parquet", "row_groups": [0]}]}
    legacy = {"index": 2, "uri": "/raw/p-3.parquet", "row_groups": [4], "rows": 5}
    assert _render(wiring.INFERENCE_SHARD_NAME, one) == "p-0.parquet, row groups 0-2, 30 rows"
    assert _render(wiring.INFERENCE_SHARD_NAME, several) == "p-1.parquet + 1 more file(s), 9 rows"
    assert _render(wiring.INFERENCE_SHARD_NAME, legacy) == "p-3.parquet, row group 4, 5 rows"
    assert _render(wiring.INFERENCE_SHARD_NAME, {"index": 0, "no_model": "rejected"}) == "nothing to score: no current model"
    assert _render(wiring.SHARD_FILE_NAME, several) == "p-1.parquet + 1 more file(s)"
    assert _render(wiring.SHARD_FILE_NAME, legacy) == "p-3.parquet"
