"""A sweep on a row budget: trials pass over nested key-hashed subsets of the train split, the same for every trial at
a rung, and report the rows seen to Hyperband; the subsets are committed once, and a retry copies nothing."""

from __future__ import annotations

import json
import os

import optuna
import pyarrow.parquet as pq
import pytest

from stagewise.core.errors import UserError
from stagewise.datasets.subsets import plan_rounds, resolve_budget
from stagewise.definitions.config import ConfigError
from stagewise.definitions.loading import load_config
from stagewise.study.studies import create, make_pruner, open_storage
from stagewise.study.summary import summarize
from stagewise.sweep import prepare_subsets, run_worker


def _keys(files: list[dict]) -> set[int]:
    return {key for entry in files for key in pq.read_table(entry["uri"], columns=["row_id"]).column(0).to_pylist()}


@pytest.mark.parametrize(("train_rows", "max_rows", "min_rows", "factor"), [
    (650_000, 500_000, 7_812, 4), (1_161, 6_000, 512, 3), (10_000, 10_000, 100, 3), (1_000, 100, 512, 3)])
def test_rounds_end_on_hyperbands_rungs_and_pass_over_the_rows_they_add(train_rows, max_rows, min_rows, factor):
    """Rounds end at max_rows / factor^k (each at or past the pruner's rung min × factor^j), the first at min_rows or
    more (but never past max_rows), the last at max_rows; a round passes over exactly the rows it adds: a subset below
    the split's size, else whole passes of the split and then a subset for the rest."""
    rounds = plan_rounds(train_rows, max_rows, min_rows, factor)
    assert rounds[-1].rows_seen == max_rows
    assert rounds[0].rows_seen >= min(min_rows, max_rows)
    assert len(rounds) == 1 or rounds[0].rows_seen * factor > min_rows
    for j, round_ in enumerate(rounds):
        assert round_.rows_seen >= rounds[0].rows_seen * factor**j
        added = round_.rows_seen - (rounds[j - 1].rows_seen if j else 0)
        assert sum(round_.subset_rows(train_rows)) == added
        assert all(0 < fraction <= 1 for fraction in round_.fractions)
        assert round_.fractions == sorted(round_.fractions, reverse=True)


def test_the_default_first_round_is_three_rungs_below_the_budget_and_holds_batches(write_config):
    config = load_config(write_config(), {"sweep.budget": "rows", "sweep.max_rows": 64_000, "sweep.batch_size": 32})
    rounds = resolve_budget(config.sweep, 100_000, processes=1)
    assert config.sweep.pruner.reduction_factor == 4  # pipeline.yaml's
    assert [r.rows_seen for r in rounds] == [1_000, 4_000, 16_000, 64_000]
    assert (rounds[0].rows_seen, rounds[-1].rows_seen) == (1_000, 64_000)
    small = load_config(write_config(), {"sweep.budget": "rows", "sweep.max_rows": 1_000, "sweep.batch_size": 32})
    assert resolve_budget(small.sweep, 100_000, processes=2)[0].rows_seen == 1_000  # 16 batches x 2 > max_rows
    with pytest.raises(UserError, match="sweep.min_rows 40 .* less than one batch"):
        resolve_budget(load_config(write_config(), {"sweep.budget": "rows", "sweep.min_rows": 40}).sweep, 1_000, 2)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"sweep.max_rows": 1000}, "set budget: rows"),
    ({"sweep.budget": "rows", "sweep.min_rows": 5000, "sweep.max_rows": 1000}, "min_rows 5000 exceeds max_rows 1000"),
    ({"sweep.budget": "rows", "sweep.entrypoint": {"script": "trial.py"}}, "use budget: epochs"),
    ({"sweep.validation_rows": 100, "sweep.entrypoint": {"script": "trial.py"}}, "reads its own validation"),
])
def test_a_row_budget_that_cannot_work_is_refused_at_load(write_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write_config(), overrides)


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "STAGEWISE_FAULT_KILL_TRIAL"):
        monkeypatch.delenv(name, raising=False)


def _row_budget(digits_run, **sweep):
    config_path, out = digits_run
    overrides = {"sweep.budget": "rows", "sweep.max_rows": 3_000, "sweep.min_rows": 300, "sweep.num_trials": 6,
                 "sweep.num_workers": 1, "sweep.batch_size": 32, "sweep.validation_rows": 120,
                 "sweep.pruner": {"type": "hyperband", "reduction_factor": 3},
                 "sweep.search_space.hidden": {"type": "categorical", "choices": [16, 32]}}
    overrides.update({f"sweep.{key}": value for key, value in sweep.items()})
    return load_config(config_path, overrides=overrides), out


def test_subsets_are_nested_key_hashed_and_committed_once(digits_run, single_process):
    """Each round's rows hold the round before's (by key), about their planned count; validation is capped alike;
    writing them again finds the committed manifest and copies nothing."""
    config, out = _row_budget(digits_run)
    first = prepare_subsets(config, out)
    with open(first["subsets_uri"]) as handle:
        committed = json.load(handle)
    increments = committed["increments"]
    assert [part["upper"] for part in increments] == sorted(part["upper"] for part in increments)
    subsets = [_keys([f for part in increments[: j + 1] for f in part["files"]]) for j in range(len(increments))]
    for smaller, larger in zip(subsets, subsets[1:]):
        assert smaller < larger
    train_rows = committed["train_rows"]
    for part, keys in zip(increments, subsets):  # the key hash is uniform: about the planned count
        assert abs(len(keys) - part["upper"] * train_rows) < 4 * (train_rows * part["upper"]) ** 0.5 + 5
    assert 60 <= sum(f["rows"] for f in committed["validation"]["files"]) <= 180
    folder = os.path.dirname(first["subsets_uri"])

    def written() -> dict[str, float]:
        return {name: os.path.getmtime(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}

    before = written()
    again = prepare_subsets(config, out)
    assert again["rounds"] == first["rounds"]
    assert written() == before


def test_trials_report_rows_seen_at_the_rounds_and_hyperband_prunes_on_rows(digits_run, single_process):
    """Every report falls on a planned round's rows-seen step; a trial that was never pruned reported at all of them
    and trained about max_rows rows (whole batches); pruned ones trained fewer; the summary counts rows consumed."""
    config, out = _row_budget(digits_run)
    rounds = prepare_subsets(config, out)["rounds"]
    steps = [r["rows_seen"] for r in rounds]
    create(config, "rows")
    run_worker(config, "rows", 0, out)
    summary = summarize(config, "rows", out)
    study = optuna.load_study(study_name="rows", storage=open_storage(config.sweep.storage))
    trials = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(trials) == 6
    for trial in trials:
        reported = sorted(trial.intermediate_values)
        assert reported == steps[: len(reported)]
        if trial.state.name == "COMPLETE":
            # subsets hold about their planned rows and each pass drops its last partial batch: within a few batches
            assert reported == steps and abs(trial.user_attrs["rows_seen"] - steps[-1]) <= 8 * 32
        else:
            assert trial.user_attrs["rows_seen"] <= reported[-1]
    assert summary["budget"] == "rows"
    assert summary["rows_consumed"] == sum(t.user_attrs["rows_seen"] for t in trials)
    assert summary["n_pruned"] >= 1 and summary["best_value"] > 0.5


def test_the_pruner_counts_rows_under_a_row_budget(write_config):
    config = load_config(write_config(), {"sweep.budget": "rows", "sweep.max_rows": 90_000})
    pruner = make_pruner(config.sweep, (3_333, 90_000))
    assert (pruner._min_resource, pruner._max_resource) == (3_333, 90_000)
    median = load_config(write_config(), {"sweep.budget": "rows", "sweep.pruner": {"type": "median", "n_warmup_steps": 2}})
    assert make_pruner(median.sweep, (1_000, 27_000))._n_warmup_steps == 3_000  # the second round's end


def test_a_worker_without_committed_subsets_says_which_step_makes_them(digits_run, single_process):
    config, out = _row_budget(digits_run)
    create(config, "missing")
    with pytest.raises(UserError, match="stagewise.sweep subsets --out"):
        run_worker(config, "missing", 0, out)
