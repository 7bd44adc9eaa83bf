"""Training stages tracked in MLflow and the MLflow registry backend, against a real `mlflow server`, read back with
MLflow's official client: each stage's nested run on one step axis across stages, a registered version that
`mlflow.pyfunc` loads and that scores raw rows as batch inference does (a team's own spec too, in a fresh process
without the spec's folder), and the champion/challenger aliases through a passing gate, a refusing gate and a
rollback."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from stagewise import infer, registry, train
from stagewise.core import storage
from stagewise.datasets.predictions import plan_inference
from stagewise.definitions.loading import load_config
from stagewise.tracking.registry import CHALLENGER, CHAMPION
from stagewise.tracking.runs import start_parent
from tests.conftest import base_config, preprocess_digits
from tests.mlflow_server import MLFLOW_PYTHON

pytestmark = pytest.mark.service


def _config(root: Path, uri: str, model_name: str, **overrides):
    raw = base_config(root)
    raw["tracking"] = {"mlflow_uri": uri, "experiment": model_name}
    raw["registry"] = {"backend": "mlflow", "model_name": model_name}
    path = root / f"{model_name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path, overrides)


def _parent(config, out: str, run_id: str) -> str:
    return start_parent(config, dag_id="ml_pipeline", run_id=run_id, out=out, config_text="", config_hash="h",
                        code_version="c")["parent_run_id"]


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory, mlflow_server):
    """The digits preprocessed and stages s1 and s2 trained in-process with tracking on; (config, run prefix, s2's result)."""
    root = tmp_path_factory.mktemp("tracked_stages")
    config = _config(root, mlflow_server.uri, "digits_stages")
    out = str(root / "runs" / "ml_pipeline" / "staged")
    preprocess_digits(root / "digits_stages.yaml", out)
    _parent(config, out, "staged")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            patch.delenv(name, raising=False)
        first = train.run_stage(config, "s1", out, {"lr": 0.05, "hidden": 32}, None)
        second = train.run_stage(config, "s2", out, {"lr": 0.05, "hidden": 32}, first["checkpoint_uri"])
    return config, out, first, second


def test_each_stage_is_a_nested_run_on_one_step_axis_across_stages(two_stages, mlflow_server):
    """A stage's run has its params (world size, global batch, rescaled lr) and per epoch loss, objective, samples/s and
    lr, stepped by optimizer steps counted across stages: s2 continues where s1 ended."""
    config, out, first, second = two_stages
    runs = mlflow_server.client("""
        exp = client.get_experiment_by_name("digits_stages").experiment_id
        emit({r.data.tags["stagewise.stage"]: {"status": r.info.status, "params": r.data.params,
              "parent": r.data.tags["mlflow.parentRunId"],
              "history": {key: [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, key)]
                          for key in ("loss", "val_accuracy", "samples_per_s", "lr")}}
              for r in client.search_runs([exp], filter_string="tags.`stagewise.kind` = 'stage'")})
    """)
    assert set(runs) == {"s1", "s2"} and runs["s1"]["parent"] == runs["s2"]["parent"]
    for result in (first, second):
        run = runs[result["stage"]]
        assert run["status"] == "FINISHED"
        assert (int(run["params"]["world_size"]), int(run["params"]["global_batch"])) == (1, result["global_batch"])
        assert float(run["params"]["stage_lr"]) == pytest.approx(result["lr"])
        for key, points in run["history"].items():
            assert len(points) == result["epochs_run"], key
    s1_steps = [step for step, _ in runs["s1"]["history"]["loss"]]
    s2_steps = [step for step, _ in runs["s2"]["history"]["loss"]]
    assert s1_steps[-1] == first["steps"] and s2_steps[0] > s1_steps[-1] and s2_steps[-1] == first["steps"] + second["steps"]
    history = json.loads(Path(out, "train", "s2", "metrics.json").read_text())["history"]
    assert [value for _, value in runs["s2"]["history"]["val_accuracy"]] == pytest.approx([h["val_metric"] for h in history])


def test_a_registered_version_loads_with_mlflow_pyfunc_and_scores_as_batch_inference(two_stages, mlflow_server, tmp_path):
    """The version is linked to the parent run, holds weights-only model.pt beside an MLmodel, and
    mlflow.pyfunc.load_model("models:/<name>@champion") in MLflow's own environment predicts on raw rows exactly
    what Stagewise's batch inference writes for them."""
    config, out, _, second = two_stages
    card = {"test_accuracy": 0.9, "objective": "accuracy", "study": "s", "source_run": "ml_pipeline/staged"}
    registered = registry.register_for(config, out, second["model_uri"], card, dag_id="ml_pipeline", run_id="staged")
    decision = registry.gate_registered(config, registered, out)
    assert decision["promoted"] and decision["current_mlflow_version"] == registered["mlflow_version"]

    raw_file = storage.list_parquet(storage.resolve(config.storage_root, config.dataset.uri))[0]
    shard = plan_inference(raw_file, 10_000)[0]
    scored = infer.score_shard(config, second["model_uri"], shard, str(tmp_path / "scored"))
    ours = pq.read_table(scored["uri"]).to_pydict()
    seen = mlflow_server.client(f"""
        import mlflow.pyfunc, pandas as pd
        version = client.get_model_version_by_alias("digits_stages", "champion")
        model = mlflow.pyfunc.load_model("models:/digits_stages@champion")
        frame = pd.read_parquet({raw_file!r})
        predicted = model.predict(frame)
        emit({{"run_id": version.run_id, "files": sorted(a.path for a in client.list_artifacts(version.run_id, "model")),
              "keys": predicted["row_id"].tolist(), "prediction": predicted["prediction"].tolist(),
              "loader": model.metadata.flavors["python_function"]["loader_module"]}})
    """)
    assert seen["run_id"] == json.loads(Path(out, "tracking", "mlflow.json").read_text())["parent_run_id"]
    assert {"model/MLmodel", "model/model.pt", "model/card.json", "model/requirements.txt"} <= set(seen["files"])
    assert seen["loader"] == "stagewise.models.mlflow_pyfunc"
    assert dict(zip(seen["keys"], seen["prediction"])) == dict(zip(ours["row_id"], ours["prediction"]))


OWN_SPEC = '''"""A team's own spec beside its config: a tanh net whose hidden block comes from a helper module beside it."""
from fresh_env_blocks import hidden_block
from torch import nn

from stagewise.spec import Classifier


class TanhNet(Classifier):
    default_params = {"hidden": 24}

    def build(self, data, params):
        width = int(params["hidden"])
        return nn.Sequential(*hidden_block(data.num_features, width), nn.Linear(width, data.num_classes))
'''
OWN_BLOCKS = '''from torch import nn


def hidden_block(inputs, width):
    return [nn.Linear(inputs, width), nn.Tanh()]
'''
FRESH_LOAD = """
import importlib.util, json, sys
importable = importlib.util.find_spec("fresh_env_tanh") is not None
import mlflow.pyfunc, pandas as pd
mlflow.set_tracking_uri(sys.argv[1])
model = mlflow.pyfunc.load_model("models:/fresh_env_model@champion")
predicted = model.predict(pd.read_parquet(sys.argv[2]))
print("RESULT " + json.dumps({"importable_before": importable, "spec_file": sys.modules["fresh_env_tanh"].__file__,
      "keys": predicted["row_id"].tolist(), "prediction": predicted["prediction"].tolist(),
      "probabilities": [list(map(float, row)) for row in predicted["probabilities"]]}))
"""


@pytest.mark.subprocess
def test_fresh_env_loads_a_users_own_spec_without_its_folder_and_predicts_as_stagewise(tmp_path, mlflow_server):
    """A model of a team's own spec (a module beside the config and a helper it imports) loads with
    mlflow.pyfunc.load_model("models:/<name>@champion") in a fresh process of MLflow's environment whose path lacks the
    spec's folder (the spec is not importable there before loading), from the source the version carries, with no
    requirements-mismatch warning, and predicts on raw rows what Stagewise's batch inference writes."""
    import numpy as np

    (tmp_path / "fresh_env_tanh.py").write_text(OWN_SPEC)
    (tmp_path / "fresh_env_blocks.py").write_text(OWN_BLOCKS)
    config = _config(tmp_path, mlflow_server.uri, "fresh_env_model",
                     **{"model.spec": "fresh_env_tanh:TanhNet", "train.stages.0.epochs": 1})
    out = str(tmp_path / "runs" / "ml_pipeline" / "own")
    preprocess_digits(tmp_path / "fresh_env_model.yaml", out)
    _parent(config, out, "own")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            patch.delenv(name, raising=False)
        trained = train.run_stage(config, "s1", out, {"lr": 0.05, "hidden": 16}, None)
    card = {"test_accuracy": 0.9, "objective": "accuracy", "source_run": "ml_pipeline/own"}
    registered = registry.register_for(config, out, trained["model_uri"], card, dag_id="ml_pipeline", run_id="own")
    assert registry.gate_registered(config, registered, out)["promoted"]
    assert [entry["path"] for entry in registered["spec_source"]["files"]] == ["fresh_env_blocks.py", "fresh_env_tanh.py"]

    raw_file = storage.list_parquet(storage.resolve(config.storage_root, config.dataset.uri))[0]
    scored = infer.score_shard(config, trained["model_uri"], plan_inference(raw_file, 10_000)[0], str(tmp_path / "scored"))
    ours = pq.read_table(scored["uri"]).to_pydict()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONSTARTUP")}
    done = subprocess.run([str(MLFLOW_PYTHON), "-c", FRESH_LOAD, mlflow_server.uri, raw_file], cwd=fresh, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert not seen["importable_before"], "the spec's folder must not be on the fresh process's path"
    spec_file = Path(seen["spec_file"])
    assert spec_file.parent.name == "code" and not spec_file.is_relative_to(tmp_path), f"not the model's: {spec_file}"
    assert "mismatches between the model's dependencies" not in done.stderr, done.stderr[-2000:]
    assert dict(zip(seen["keys"], seen["prediction"])) == dict(zip(ours["row_id"], ours["prediction"]))
    order = {key: index for index, key in enumerate(seen["keys"])}
    theirs = np.array([seen["probabilities"][order[key]] for key in ours["row_id"]])
    assert np.allclose(theirs, np.array(ours["probabilities"]), atol=1e-6)


def test_the_gate_moves_champion_only_when_the_candidate_passes_and_rollback_moves_it_back(tmp_path, mlflow_server):
    """challenger always points at the newest candidate; champion moves only on a pass; a refused version is tagged with
    why; rollback restores the former champion; inference and retraining read @champion."""
    config = _config(tmp_path, mlflow_server.uri, "gated_model")
    numbers = {}
    for label, accuracy in (("first", 0.90), ("worse", 0.85), ("better", 0.95)):
        out = str(tmp_path / "runs" / label)
        _parent(config, out, label)
        model = tmp_path / f"{label}.pt"
        model.write_bytes(label.encode() * 100)
        card = {"test_accuracy": accuracy, "objective": "accuracy", "study": f"study-{label}", "source_run": label}
        registered = registry.register_for(config, out, str(model), card, dag_id="ml_pipeline", run_id=label)
        assert registry.register_for(config, out, str(model), card, dag_id="ml_pipeline", run_id=label)["mlflow_version"] \
            == registered["mlflow_version"], "a retry finds its version"
        decision = registry.gate_registered(config, registered, out)
        numbers[label] = registered["mlflow_version"]
        aliases = mlflow_server.client("""
            emit({alias: client.get_model_version_by_alias("gated_model", alias).version for alias in ("champion", "challenger")})
        """)
        assert aliases[CHALLENGER] == registered["mlflow_version"]
        if label == "worse":
            assert not decision["promoted"] and aliases[CHAMPION] == numbers["first"]
            assert storage.read_bytes(decision["model_uri"]) == b"first" * 100, "this run's inference scores with the champion"
            tags = mlflow_server.client(f"""emit(client.get_model_version("gated_model", "{registered['mlflow_version']}").tags)""")
            assert tags["stagewise.gate"] == "refused" and "0.8500 <= current 0.9000" in tags["stagewise.gate_reason"]
        else:
            assert decision["promoted"] and aliases[CHAMPION] == registered["mlflow_version"]
    assert registry.retrain_overrides(config)["sweep.warm_start_from"] == "study-better"

    out = str(tmp_path / "runs" / "serve")
    served = registry.serving_model(config, None, out)
    assert served["mlflow_version"] == numbers["better"] and storage.read_bytes(served["model_uri"]) == b"better" * 100
    registry.main(["rollback", "--config", str(tmp_path / "gated_model.yaml")])
    champion = mlflow_server.client("""emit(client.get_model_version_by_alias("gated_model", "champion").version)""")
    assert champion == numbers["first"]
    assert storage.read_bytes(registry.serving_model(config, None, out)["model_uri"]) == b"first" * 100
    pinned = registry.serving_model(config, numbers["worse"], out)
    assert storage.read_bytes(pinned["model_uri"]) == b"worse" * 100, "a model_version Param picks that version"


@pytest.mark.slow
def test_with_artifacts_on_s3_a_version_registers_and_loads_through_the_server(two_stages, mlflow_servers, s3_bucket, s3_env):
    """A server whose artifact store is the S3 endpoint: the parent run's config, the version's bundle and its MLmodel
    land in the bucket, and mlflow.pyfunc loads models:/<name>@champion through the server, with no S3 keys of its own."""
    import s3fs

    _, out, _, second = two_stages
    server = mlflow_servers("s3", artifacts=f"{s3_bucket}/mlflow",
                            env={**s3_env, "MLFLOW_S3_ENDPOINT_URL": s3_env["AWS_ENDPOINT_URL"]})
    root = Path(out).parent / "s3_variant"
    root.mkdir()
    config = _config(root, server.uri, "digits_s3")
    run_out = str(root / "runs" / "ml_pipeline" / "on_s3")
    _parent(config, run_out, "on_s3")
    registered = registry.register_for(config, run_out, second["model_uri"], {"test_accuracy": 0.9, "objective": "accuracy"},
                                       dag_id="ml_pipeline", run_id="on_s3")
    assert registry.gate_registered(config, registered, run_out)["promoted"]
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_env["AWS_ENDPOINT_URL"]}, skip_instance_cache=True)
    stored = [path.rsplit("/", 1)[-1] for path in fs.find(f"{s3_bucket}/mlflow")]
    assert {"config.yaml", "model.pt", "MLmodel", "card.json"} <= set(stored)
    loaded = server.client("""
        import mlflow.pyfunc
        emit(mlflow.pyfunc.load_model("models:/digits_s3@champion").metadata.flavors["python_function"]["loader_module"])
    """, AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="")
    assert loaded == "stagewise.models.mlflow_pyfunc"
    served = registry.serving_model(config, None, run_out)
    assert storage.read_bytes(served["model_uri"]) == storage.read_bytes(second["model_uri"])


def _another_teams_model(mlflow_server, name: str) -> None:
    """A registered model another team made in MLflow itself: its own tags, a version of theirs as @champion."""
    mlflow_server.client(f"""
        client.create_registered_model({name!r}, tags={{"team": "risk"}})
        version = client.create_model_version({name!r}, "s3://risk-models/scorer/7", tags={{"owner": "risk-scoring"}})
        client.set_registered_model_alias({name!r}, "champion", version.version)
    """)


def test_a_model_name_another_team_holds_in_mlflow_is_refused_naming_its_owner(tmp_path, mlflow_server):
    """registry.model_name names a model another team made in MLflow: the owner check and the registration each refuse
    it as a user error naming the model, what MLflow records of its version (not Stagewise's, its source, tags) and
    the setting to change; no version is added to theirs and their champion stays."""
    from stagewise.core.errors import UserError
    from stagewise.tracking.registry import check_owner

    _another_teams_model(mlflow_server, "risk_scorer")
    config = _config(tmp_path, mlflow_server.uri, "risk_scorer")
    with pytest.raises(UserError) as refused:
        check_owner(config, "ml")
    said = str(refused.value)
    assert said.startswith(f"registry.model_name 'risk_scorer': the MLflow registry at {mlflow_server.uri} holds a "
                           f"model of that name that is not pipeline 'ml''s (1 of its versions are not this pipeline's: "
                           f"version 1 not made by Stagewise, run (none), source s3://risk-models/scorer/7")
    assert "tags {'owner': 'risk-scoring'}" in said and "the model's tags {'team': 'risk'}" in said
    assert "Set registry.model_name to a name of this pipeline's own, e.g. 'ml_risk_scorer'" in said

    out = str(tmp_path / "runs" / "ml_pipeline" / "r1")
    _parent(config, out, "r1")
    model = tmp_path / "model.pt"
    model.write_bytes(b"weights")
    with pytest.raises(UserError, match="registry.model_name 'risk_scorer'.*not pipeline 'ml''s"):
        registry.register_for(config, out, str(model), {"test_accuracy": 0.9, "source_run": "ml_pipeline/r1"},
                              dag_id="ml_pipeline", run_id="r1")
    theirs = mlflow_server.client("""
        emit({"versions": [v.version for v in client.search_model_versions("name = 'risk_scorer'")],
              "champion": client.get_model_version_by_alias("risk_scorer", "champion").version})
    """)
    assert theirs == {"versions": ["1"], "champion": "1"}


def test_the_first_registration_tags_the_model_with_its_pipeline_and_another_pipeline_is_refused(tmp_path, mlflow_server):
    """Pipeline ml's first version tags the model stagewise.pipeline=ml; ml registers again freely; pipeline churn under
    the same name is refused naming the tag's pipeline. A Stagewise model from before the tag (ml's versions only) is
    ml's: its next registration puts the tag back."""
    from stagewise.core.errors import UserError
    from stagewise.tracking.registry import OWNER_TAG, check_owner

    config = _config(tmp_path, mlflow_server.uri, "owned_model")
    model = tmp_path / "model.pt"
    for number in (1, 2):
        out = str(tmp_path / "runs" / "ml_pipeline" / f"r{number}")
        _parent(config, out, f"r{number}")
        model.write_bytes(b"weights %d" % number)
        registry.register_for(config, out, str(model), {"test_accuracy": 0.9, "source_run": f"ml_pipeline/r{number}"},
                              dag_id="ml_pipeline", run_id=f"r{number}")
    tags = mlflow_server.client("""emit(client.get_registered_model("owned_model").tags)""")
    assert tags[OWNER_TAG] == "ml"
    check_owner(config, "ml")
    with pytest.raises(UserError, match=f"not pipeline 'churn''s \\(its tag {OWNER_TAG} names pipeline 'ml'\\)"):
        check_owner(config, "churn")

    mlflow_server.client(f"""client.delete_registered_model_tag("owned_model", "{OWNER_TAG}")""")
    check_owner(config, "ml")  # every version is ml's
    with pytest.raises(UserError, match="version 2 by Stagewise pipeline 'ml' \\(ml_pipeline/r2\\)"):
        check_owner(config, "churn")
    out = str(tmp_path / "runs" / "ml_pipeline" / "r3")
    _parent(config, out, "r3")
    model.write_bytes(b"weights 3")
    registry.register_for(config, out, str(model), {"test_accuracy": 0.9, "source_run": "ml_pipeline/r3"},
                          dag_id="ml_pipeline", run_id="r3")
    assert mlflow_server.client("""emit(client.get_registered_model("owned_model").tags)""")[OWNER_TAG] == "ml"
