"""Trigger-form Params map onto config overrides; profiles map onto Airflow's own knobs."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from stagewise.airflow.params import overrides_from_params, pipeline_params, unknown_trigger_keys
from stagewise.airflow.profiles import task_kwargs
from stagewise.definitions.config import Profile
from stagewise.definitions.loading import load_config


def _defaults(config) -> dict:
    return {name: param.resolve() for name, param in pipeline_params(config).items()}


def test_param_defaults_reproduce_the_config():
    """Triggering with the form's defaults runs exactly the config file."""
    config = load_config()
    assert load_config(overrides=overrides_from_params(config, _defaults(config))) == config


def test_params_override_budget_workers_and_stage_epochs():
    """Values set in the form reach the sweep and each training stage."""
    config = load_config()
    params = {**_defaults(config), "num_trials": 5, "num_sweep_workers": 3, "stage_epochs": {"s2": 4}}
    changed = load_config(overrides=overrides_from_params(config, params))
    assert changed.sweep.num_trials == 5 and changed.sweep.num_workers == 3
    assert changed.stage("s2").epochs == 4 and changed.stage("s1").epochs == config.stage("s1").epochs


def test_the_form_switches_the_sweep_to_a_row_budget_and_back(write_config, storage_root):
    """sweep_budget rows with sweep_max_rows sets the row budget; on a config written with a row budget, switching
    the form back to epochs drops the row budget's sizes, so that run takes the epoch budget."""
    from tests.conftest import base_config

    config = load_config()
    rows = load_config(overrides=overrides_from_params(config, {**_defaults(config), "sweep_budget": "rows",
                                                                "sweep_max_rows": 200_000}))
    assert (rows.sweep.budget, rows.sweep.max_rows) == ("rows", 200_000)
    raw = base_config(storage_root)
    raw["sweep"].update({"budget": "rows", "max_rows": 300_000, "min_rows": 1_000})
    path = write_config(raw)
    written = load_config(path)
    assert _defaults(written)["sweep_max_rows"] == 300_000
    back = load_config(path, overrides_from_params(written, {**_defaults(written), "sweep_budget": "epochs"}))
    assert (back.sweep.budget, back.sweep.max_rows, back.sweep.min_rows) == ("epochs", None, None)


def test_objective_limit_reaches_evaluate():
    """The form's objective_limit becomes evaluate.objective_limit; left empty it sets no limit."""
    config = load_config()
    assert load_config(overrides=overrides_from_params(config, {**_defaults(config), "objective_limit": 0.9})
                       ).evaluate.objective_limit == 0.9
    assert load_config(overrides=overrides_from_params(config, _defaults(config))).evaluate.objective_limit is None


@pytest.mark.parametrize("name,value", [("num_trials", 0), ("num_sweep_workers", 100), ("sweep_epochs", -1),
                                        ("sweep_budget", "samples"), ("sweep_max_rows", 0),
                                        ("min_test_accuracy", 1.5), ("stage_epochs", {"s9": 3})])
def test_out_of_bounds_params_are_refused(name, value):
    """The JSON-schema bounds refuse bad form values before a run starts."""
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    params = ParamsDict(pipeline_params(load_config()))
    with pytest.raises(ParamValidationError, match=f"param {name}"):
        params[name] = value  # assignment validates, as a trigger's conf does
        params.validate()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", ["objective_limit", "min_test_accuracy"])
def test_nan_and_infinity_are_refused_by_every_float_param(name, value):
    """REST conf is read by Python's JSON, which takes NaN and Infinity; NaN passes any minimum/maximum and Airflow
    stores it as null ("no limit"), so the schema refuses both, in the task SDK's Params and in the api-server's
    (SerializedParam: what a REST trigger is validated by), with a message that says why; finite values pass."""
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError
    from airflow.serialization.definitions.param import SerializedParam

    param = pipeline_params(load_config())[name]
    params = ParamsDict({name: param})
    with pytest.raises(ParamValidationError, match=f"param {name}"):
        params[name] = value
        params.validate()
    with pytest.raises(Exception, match="NaN and Infinity are refused"):
        SerializedParam(value, param.description, **param.schema).resolve(raises=True)
    assert SerializedParam(0.5, param.description, **param.schema).resolve(raises=True) == 0.5


@pytest.mark.parametrize("form,name,value", [
    ("pipeline", "warm_start_study", "x" * 1_000_000), ("pipeline", "input_uri", "raw/" + "d" * 2000),
    ("inference", "input_uri", "s3://b/" + "k" * 1100), ("inference", "model_version", "../other/m-0ther0000001"),
    ("inference", "model_version", "m-x/../m-y"), ("inference", "model_version", "../../models/digits/m-0123456789ab")])
def test_oversized_strings_and_traversing_model_versions_are_refused_by_the_form(form, name, value):
    """Every string Param is bounded and a model version is one id (m-<12 hex>), so neither reaches a sub-job."""
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    from stagewise.airflow.params import inference_params

    params = ParamsDict((pipeline_params if form == "pipeline" else inference_params)(load_config()))
    with pytest.raises(ParamValidationError, match=f"param {name}"):
        params[name] = value
        params.validate()


def test_profile_maps_to_pool_queue_retries_and_timeout():
    """Pool slots bound concurrency, the queue routes, retries back off exponentially with a cap."""
    kwargs = task_kwargs(Profile(pool="gpus", pool_slots=2, queue="gpu", retries=3, retry_delay_s=10,
                                 retry_backoff=2.0, max_retry_delay_s=60, execution_timeout_s=120))
    assert kwargs["pool"] == "gpus" and kwargs["pool_slots"] == 2 and kwargs["queue"] == "gpu"
    assert kwargs["retries"] == 3 and kwargs["retry_delay"] == timedelta(seconds=10)
    assert kwargs["retry_exponential_backoff"] == 2.0 and kwargs["max_retry_delay"] == timedelta(seconds=60)
    assert kwargs["execution_timeout"] == timedelta(seconds=120)


def _dag_params() -> dict:
    """Every DAG's Params as Airflow's parser serializes them, by DAG id."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags"))
    assert bag.import_errors == {}
    return {dag_id: dag.params for dag_id, dag in bag.dags.items()}


def _form_flags_as_missing(param) -> bool:
    """The UI's rule: a typed param without "null" in its type is required, and an empty value then disables Trigger."""
    kind = param.schema.get("type")
    required = bool(kind) and not (isinstance(kind, list) and "null" in kind)
    return required and param.value in (None, "")


def test_every_trigger_form_opens_with_only_truly_required_fields_empty():
    """Each DAG's form, of every pipeline in the checkout, can be triggered with its defaults; only each ingest's
    source_uri (no sensible default) must be filled."""
    flagged = {(dag_id, name) for dag_id, params in _dag_params().items()
               for name in params if _form_flags_as_missing(params.get_param(name))}
    assert flagged == {(f"{name}_ingest", "source_uri") for name in ("ml", "digits_cnn", "diabetes", "ddp_tutorial", "token_transformer",
                                                                              "decoder", "imbalanced")}


def test_number_params_state_their_bounds_in_the_description():
    """The form clamps out-of-range numbers silently, so every bounded Param's description names its bounds."""
    checked = 0
    for dag_id, params in _dag_params().items():
        for name in params:
            param = params.get_param(name)
            schemas = [param.schema, *(param.schema.get("properties") or {}).values()]
            for schema in schemas:
                if "minimum" in schema or "maximum" in schema:
                    bounds = f"{schema['minimum']} to {schema['maximum']}"
                    assert bounds in (param.description or ""), f"{dag_id}.{name}: {param.description!r} lacks {bounds}"
                    checked += 1
    assert checked >= 6, "the pipeline forms have bounded params"


def test_empty_optional_strings_mean_cold_start_and_current_model():
    """A form left empty sends null for warm_start_study; that maps onto the config's cold start ("")."""
    config = load_config()
    for empty in (None, ""):
        params = {**_defaults(config), "warm_start_study": empty}
        assert load_config(overrides=overrides_from_params(config, params)).sweep.warm_start_from == ""
    params = {**_defaults(config), "warm_start_study": "ml_pipeline__earlier"}
    assert load_config(overrides=overrides_from_params(config, params)).sweep.warm_start_from == "ml_pipeline__earlier"


def test_unknown_trigger_keys_are_named_and_known_ones_pass():
    """A typo in a run's conf (num_trails) is reported; declared Params and an empty conf are not."""
    known = pipeline_params(load_config())
    assert unknown_trigger_keys({"num_trails": 3, "seed": 1}, known) == ["num_trails"]
    assert unknown_trigger_keys({"num_trials": 3}, known) == []
    assert unknown_trigger_keys(None, known) == []


def test_a_pool_the_deployment_already_has_keeps_its_slots(write_config):
    """ensure_pools creates a missing pool with the config's slots and leaves an existing one (the team's) as it is."""
    import uuid

    import yaml
    from airflow.models.pool import Pool

    from stagewise.airflow.pools import ensure_pools

    owned, missing = f"team_gpus_{uuid.uuid4().hex[:6]}", f"new_pool_{uuid.uuid4().hex[:6]}"
    Pool.create_or_update_pool(name=owned, slots=8, description="the team's", include_deferred=False)
    path = write_config()
    raw = yaml.safe_load(path.read_text())
    raw["pools"].update({owned: {"slots": 2}, missing: {"slots": 3}})
    path.write_text(yaml.safe_dump(raw))
    try:
        outcome = ensure_pools(str(path))
        assert (outcome[owned], outcome[missing]) == ("kept (8 slots)", "created")
        assert (Pool.get_pool(owned).slots, Pool.get_pool(owned).description) == (8, "the team's")
        assert Pool.get_pool(missing).slots == 3
    finally:
        for name in (owned, missing):
            if Pool.get_pool(name) is not None:
                Pool.delete_pool(name)
