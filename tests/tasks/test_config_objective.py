"""The objective in the pipeline config: a metric the spec does not compute, or a built-in one of the other kind of
target, is a ConfigError naming objective.metric and the metrics there are; the direction comes from the metric;
evaluate.threshold's rule takes its target."""

from __future__ import annotations

import pytest

from stagewise.definitions.config import ConfigError
from stagewise.definitions.loading import load_config
from tests.conftest import base_config


def _load_error(write_config, raw: dict) -> str:
    """Write ``raw``, load it, and return the ConfigError's message (failing if it loads)."""
    path = write_config(raw)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return str(caught.value)


def test_an_objective_the_builtin_spec_does_not_compute_names_the_key_and_the_metrics(write_config, storage_root):
    """objective.metric: no_such_metric is refused at the config check, naming the key and every metric there is."""
    raw = base_config(storage_root)
    raw["objective"] = {"metric": "no_such_metric"}
    message = _load_error(write_config, raw)
    assert "objective.metric: 'no_such_metric' is not a metric stagewise.model:MLPClassifier computes" in message
    assert "f1_macro" in message and "auprc" in message and "log_loss" in message


def test_a_builtin_metric_of_the_other_kind_of_target_is_refused_for_a_users_spec(write_config, storage_root):
    """A user's spec may add metrics, but auroc on a float target (no num_classes) can only be a mistake."""
    raw = base_config(storage_root)
    raw["model"] = {"spec": "stagewise.examples.diabetes:DiabetesMLP", "args": {}}
    raw["dataset"].pop("num_classes")
    raw["objective"] = {"metric": "auroc"}
    raw["registry"].pop("gate_metric", None)
    message = _load_error(write_config, raw)
    assert "objective.metric: 'auroc' is a classification metric" in message and "rmse, mae, r2, loss" in message


@pytest.mark.parametrize("metric, direction", [("log_loss", "minimize"), ("auprc", "maximize"), ("loss", "minimize"),
                                               ("my_own_score", "maximize")])
def test_the_objectives_direction_is_the_metrics_own_when_left_out(write_config, storage_root, metric, direction):
    """A minimised built-in metric needs no direction; a user's own metric is maximised unless the config says so."""
    raw = base_config(storage_root)
    raw["objective"] = {"metric": metric}
    raw["registry"].pop("gate_metric", None)
    if metric == "my_own_score":
        raw["model"] = {"spec": "tests.specs:LogLoss", "args": {}}
    assert load_config(write_config(raw)).objective.direction == direction


def test_a_direction_that_contradicts_a_builtin_metric_is_refused(write_config, storage_root):
    """Maximising log_loss would pick the worst model everywhere: refused, saying which way the metric goes."""
    raw = base_config(storage_root)
    raw["objective"] = {"metric": "log_loss", "direction": "maximize"}
    message = _load_error(write_config, raw)
    assert "objective.direction: maximize contradicts objective.metric 'log_loss'" in message and "minimize" in message


def test_a_threshold_rule_takes_its_target(write_config, storage_root):
    """evaluate.threshold: precision and recall need the value to reach; f1 takes none."""
    raw = base_config(storage_root)
    raw["evaluate"]["threshold"] = {"rule": "precision"}
    assert "rule precision needs the precision to reach" in _load_error(write_config, raw)
    raw["evaluate"]["threshold"] = {"rule": "f1", "target": 0.9}
    assert "rule f1 takes no target" in _load_error(write_config, raw)
    raw["evaluate"]["threshold"] = {"rule": "recall", "target": 0.8}
    assert load_config(write_config(raw)).evaluate.threshold.target == 0.8


def test_the_cli_check_names_an_objective_a_users_classifier_does_not_report(write_config, storage_root, capsys):
    """A user's Classifier that keeps the built-in metrics(): `python -m stagewise.config` imports it and refuses an
    objective it does not report, listing what it does (model.args.metrics narrows them); a spec with metrics of
    its own passes here (its first batch checks it)."""
    from stagewise.config import main

    raw = base_config(storage_root)
    raw["model"] = {"spec": "stagewise.examples.digits_cnn:DigitsCNN", "args": {"metrics": ["accuracy", "auroc"]}}
    raw["objective"] = {"metric": "recall_at_p90"}
    raw["registry"].pop("gate_metric", None)
    with pytest.raises(SystemExit, match=r"objective.metric: 'recall_at_p90' is not a metric "
                                         r"stagewise.examples.digits_cnn:DigitsCNN reports; it reports accuracy, auroc, loss"):
        main([str(write_config(raw))])
    raw["model"] = {"spec": "tests.specs:LogLoss", "args": {}}
    main([str(write_config(raw))])
    assert "recall_at_p90" in capsys.readouterr().out
