"""The sweep: an exact trial budget split between workers, idempotent retries, a summary that fails when nothing completed."""

from __future__ import annotations

import optuna
import pytest

from stagewise.core import storage
from stagewise.core.errors import UserError
from stagewise.definitions.loading import load_config
from stagewise.study.studies import create, open_storage, study_name
from stagewise.study.summary import summarize
from stagewise.sweep import run_worker, worker_quota


@pytest.fixture
def single_process(monkeypatch):
    """No torchrun variables: each worker runs its trials in this process."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "STAGEWISE_FAULT_KILL_TRIAL"):
        monkeypatch.delenv(name, raising=False)


def _load(config, name: str):
    return optuna.load_study(study_name=name, storage=open_storage(config.sweep.storage))


def _counted(study) -> list:
    return [t for t in study.get_trials() if t.state.name in ("COMPLETE", "PRUNED", "FAIL")
            and not t.user_attrs.get("abandoned")]


@pytest.mark.parametrize("num_workers", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("num_trials", [1, 2, 5, 8, 12, 13, 100])
def test_worker_quotas_sum_exactly_to_the_budget(num_trials, num_workers):
    """However the budget divides, the quotas add up to it and differ by at most one."""
    quotas = [worker_quota(num_trials, num_workers, w) for w in range(num_workers)]
    assert sum(quotas) == num_trials
    assert max(quotas) - min(quotas) <= 1 and min(quotas) >= 0
    assert quotas == sorted(quotas, reverse=True), "earlier workers take the remainder"


@pytest.mark.parametrize("worker", [-1, 3, 10])
def test_worker_index_outside_the_pool_is_a_user_error(worker):
    """A worker index outside 0..num_workers-1 is refused, naming sweep.num_workers."""
    with pytest.raises(UserError, match="sweep.num_workers"):
        worker_quota(8, 3, worker)


def test_study_name_is_safe_and_per_run():
    """Study names are path/DB safe and differ between runs of one DAG."""
    first = study_name("ml_pipeline", "manual__2024-01-01T00:00:00+00:00")
    assert first == storage.safe_name(first)
    assert first != study_name("ml_pipeline", "manual__2024-01-02T00:00:00+00:00")


def _fast_config(digits_run, **sweep):
    config_path, out = digits_run
    overrides = {"sweep.epochs": 2, "sweep.num_trials": 5, "sweep.num_workers": 2, "sweep.batch_size": 64,
                 "sweep.search_space.hidden": {"type": "categorical", "choices": [16, 32]}}
    overrides.update({f"sweep.{key}": value for key, value in sweep.items()})
    return load_config(config_path, overrides=overrides), out


def test_two_workers_spend_exactly_the_budget_and_a_retry_adds_nothing(digits_run, single_process):
    """Workers 0 and 1 (run one after the other) leave exactly num_trials trials; re-running worker 0 adds none."""
    config, out = _fast_config(digits_run)
    create(config, "pair")
    results = [run_worker(config, "pair", worker, out) for worker in range(2)]
    assert [r["trials_run"] for r in results] == [worker_quota(5, 2, w) for w in range(2)]
    study = _load(config, "pair")
    assert len(study.trials) == len(_counted(study)) == 5
    for worker in range(2):
        owned = [t for t in study.trials if t.user_attrs.get("worker") == worker]
        assert len(owned) == worker_quota(5, 2, worker)

    retry = run_worker(config, "pair", 0, out)
    assert retry["trials_run"] == 0 and retry["epochs_run"] == 0
    assert len(_load(config, "pair").trials) == 5


def test_create_is_idempotent(digits_run, single_process):
    """Creating the study again (a cleared create task) finds the same study and keeps its trials."""
    config, out = _fast_config(digits_run, num_trials=1, num_workers=1)
    create(config, "again")
    run_worker(config, "again", 0, out)
    create(config, "again")
    assert len(_load(config, "again").trials) == 1


@pytest.mark.parametrize("other", [{"registry.model_name": "diabetes"},
                                   {"objective.metric": "log_loss", "objective.direction": "minimize"}])
def test_a_study_of_another_pipeline_or_objective_is_refused_not_joined(write_config, other):
    """Two pipelines sharing sweep.storage and a study name never mix trials: the second create names the owner."""
    path = write_config()
    create(load_config(path), "shared")
    with pytest.raises(UserError, match=r"study 'shared' .* belongs to another pipeline or objective .*not joined"):
        create(load_config(path, other), "shared")
    create(load_config(path), "shared")  # its own pipeline finds it again


def test_retry_after_a_dead_attempt_keeps_the_budget(digits_run, single_process):
    """A trial left RUNNING by a dead attempt is failed as abandoned and does not count against the worker's quota."""
    config, out = _fast_config(digits_run, num_trials=2, num_workers=1)
    create(config, "dead")
    study = _load(config, "dead")
    orphan = study.ask({"lr": optuna.distributions.FloatDistribution(0.005, 0.3, log=True)})
    orphan.set_user_attr("worker", 0)  # what the killed attempt had done before dying
    run_worker(config, "dead", 0, out)
    study = _load(config, "dead")
    left = [t for t in study.trials if t.number == orphan.number][0]
    assert left.state.name == "FAIL" and left.user_attrs.get("abandoned")
    assert len(_counted(study)) == 2
    assert not [t for t in study.trials if t.state.name == "RUNNING"]


def test_summary_counts_and_file(digits_run, single_process):
    """summarize writes sweep/summary.json whose counts add up to the trials and whose best is a completed trial."""
    config, out = _fast_config(digits_run, num_trials=3, num_workers=1, pruner={"type": "none"})
    create(config, "summed")
    run_worker(config, "summed", 0, out)
    summary = summarize(config, "summed", out)
    written = storage.read_json(storage.join(out, "sweep", "summary.json"))
    assert written == summary
    assert summary["n_trials"] == summary["n_complete"] + summary["n_pruned"] + summary["n_failed"] == 3
    study = _load(config, "summed")
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert summary["best_value"] == max(t.value for t in complete)
    assert 0.0 <= summary["best_value"] <= 1.0 and "lr" in summary["best_params"]
    assert summary["epochs_consumed"] == sum(t.user_attrs["epochs"] for t in study.trials)
    assert summary["strategy"] == {"name": "ddp", "world_size": 1, "units": None}


def test_a_sharded_trial_logs_and_records_its_strategy_world_size_and_units(digits_run, single_process, caplog):
    """sweep.strategy fsdp: each trial's log line names its world size and how it sharded (the strategy's own words,
    with its units), the study records strategy, world_size and units on each trial, and trials.json and the
    summary carry them."""
    import logging

    config, out = _fast_config(digits_run, num_trials=2, num_workers=1, epochs=1, strategy="fsdp",
                               pruner={"type": "none"})
    create(config, "spread")
    with caplog.at_level(logging.INFO, logger="stagewise.sweep"):
        run_worker(config, "spread", 0, out)
    trials = _load(config, "spread").trials
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"], [t.user_attrs for t in trials]
    for trial in trials:
        attrs = trial.user_attrs
        assert (attrs["strategy"], attrs["world_size"]) == ("fsdp", 1) and attrs["units"] >= 2, attrs
        line = f"trial {trial.number}: world size 1 (fsdp over 1 rank(s): {attrs['units']} units)"
        assert any(record.getMessage().startswith(line) for record in caplog.records), line
    summary = summarize(config, "spread", out)
    best = next(t for t in trials if t.number == summary["best_trial"])
    assert summary["strategy"] == {"name": "fsdp", "world_size": 1, "units": best.user_attrs["units"]}
    records = storage.read_json(summary["trials_uri"])["trials"]
    assert [(r["strategy"], r["world_size"], r["units"]) for r in records] == \
        [("fsdp", 1, t.user_attrs["units"]) for t in trials]


def test_all_trials_failing_makes_the_summary_a_user_error(digits_run, single_process):
    """A search space whose every point breaks the objective records FAIL trials; summarize fails naming the reason."""
    # An absurd learning rate makes every trial's loss NaN/inf in its first epoch.
    config, out = _fast_config(digits_run, num_trials=2, num_workers=1,
                               **{"search_space.lr": {"type": "float", "low": 1e5, "high": 1e6, "log": True}})
    create(config, "broken")
    result = run_worker(config, "broken", 0, out)
    assert result["trials_run"] == 2 and result["epochs_run"] == 0
    study = _load(config, "broken")
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"]
    assert all("training diverged" in t.user_attrs["error"] for t in study.trials)
    with pytest.raises(UserError, match="training diverged") as caught:
        summarize(config, "broken", out)
    assert "broken" in str(caught.value)
    assert not storage.exists(storage.join(out, "sweep", "summary.json")), "no summary is published for a failed sweep"


def test_diverging_trial_is_failed_with_its_reason_and_the_sweep_goes_on(digits_run, single_process):
    """A trial whose loss turns NaN (lr 1e6) becomes a FAIL trial naming the divergence; the next trial still runs
    and the summary's best is the trial that trained."""
    config, out = _fast_config(digits_run, num_trials=2, num_workers=1, pruner={"type": "none"},
                               **{"search_space.lr": {"type": "float", "low": 0.01, "high": 1e6, "log": True}})
    create(config, "diverging")
    study = _load(config, "diverging")
    study.enqueue_trial({"lr": 1e6, "hidden": 16})
    study.enqueue_trial({"lr": 0.05, "hidden": 16})
    result = run_worker(config, "diverging", 0, out)
    assert result["trials_run"] == 2
    first, second = sorted(_load(config, "diverging").trials, key=lambda t: t.number)
    assert first.state.name == "FAIL" and "training diverged" in first.user_attrs["error"]
    assert "lr 1e+06" in first.user_attrs["error"]
    assert second.state.name == "COMPLETE" and second.user_attrs["steps"] > 0
    summary = summarize(config, "diverging", out)
    assert summary["n_failed"] == 1 and summary["n_complete"] == 1 and summary["best_params"]["lr"] == 0.05


def test_batch_size_beyond_a_ranks_rows_is_refused_before_any_trial(digits_run, single_process):
    """sweep.batch_size larger than a rank's train rows would make every trial take 0 steps: the worker refuses
    before asking for a trial, naming sweep.batch_size, the rows per rank and the process count."""
    config, out = _fast_config(digits_run, num_trials=2, num_workers=1, batch_size=100000)
    create(config, "too_big")
    with pytest.raises(UserError) as caught:
        run_worker(config, "too_big", 0, out)
    message = str(caught.value)
    assert "sweep.batch_size 100000 exceeds the ~" in message and "train rows each of 1 process(es)" in message
    assert _load(config, "too_big").trials == [], "no trial was started"


def test_trial_that_took_no_step_never_counts_as_complete(digits_run, single_process):
    """A COMPLETE trial recorded with 0 optimizer steps (a random init's accuracy) counts as failed: it is never
    the best, and a study with only such trials fails its summary."""
    config, out = _fast_config(digits_run, num_trials=2, num_workers=1)
    create(config, "untrained")
    study = _load(config, "untrained")
    space = {"lr": optuna.distributions.FloatDistribution(0.005, 0.3, log=True)}
    untrained = study.ask(space)
    untrained.set_user_attr("steps", 0)
    study.tell(untrained, 0.99)
    with pytest.raises(UserError, match="took 0 optimizer steps"):
        summarize(config, "untrained", out)
    trained = study.ask(space)
    trained.set_user_attr("steps", 30)
    study.tell(trained, 0.5)
    summary = summarize(config, "untrained", out)
    assert summary["best_trial"] == trained.number and summary["best_value"] == 0.5
    assert summary["n_complete"] == 1 and summary["n_failed"] == 1


def test_params_that_cannot_be_suggested_fail_the_trial_not_the_worker(digits_run, single_process):
    """When suggest() raises (here: the space was edited after the study began, so 'hidden' changes kind), the
    trial is recorded as FAIL with the reason and the worker finishes its quota instead of crashing."""
    config, out = _fast_config(digits_run, num_trials=2, num_workers=2, sampler={"type": "random"})
    create(config, "edited")
    run_worker(config, "edited", 0, out)
    edited, _ = _fast_config(digits_run, num_trials=2, num_workers=2, sampler={"type": "random"},
                             **{"search_space.hidden": {"type": "int", "low": 16, "high": 32}})
    assert run_worker(edited, "edited", 1, out)["trials_run"] == 1
    failed = [t for t in _load(config, "edited").trials if t.user_attrs.get("worker") == 1]
    assert [t.state.name for t in failed] == ["FAIL"]
    assert "suggesting params failed" in failed[0].user_attrs["error"]


def test_objective_fault_injected_in_the_model_fails_each_trial(digits_run, single_process, monkeypatch):
    """An exception from model building (forced on purpose) fails the trial with its message; the worker carries on."""
    config, out = _fast_config(digits_run, num_trials=2, num_workers=1)

    def broken(spec, data, params):
        raise RuntimeError("forced fault")

    monkeypatch.setattr("stagewise.models.building.build", broken)
    create(config, "forced")
    assert run_worker(config, "forced", 0, out)["trials_run"] == 2
    with pytest.raises(UserError, match="forced fault"):
        summarize(config, "forced", out)



def test_the_sweeps_eta_follows_the_pace_of_every_worker_together():
    """Four of ten trials done 40 s after the first started (two workers at once): 10 s a trial, 60 s to go; none
    finished yet: no ETA."""
    import datetime as dt
    from types import SimpleNamespace

    from stagewise.sweep import sweep_eta

    start = dt.datetime(2026, 1, 1, 12, 0, 0)
    finished = [SimpleNamespace(datetime_start=start + dt.timedelta(seconds=s)) for s in (0, 1, 20, 21)]
    assert sweep_eta(finished, 10, start + dt.timedelta(seconds=40)) == pytest.approx(60.0)
    assert sweep_eta([], 10, start) is None
