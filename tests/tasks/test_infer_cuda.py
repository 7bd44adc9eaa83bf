"""Scoring on a GPU agrees with scoring on the CPU: inference shards and evaluate.

Tolerance (stated in tasks/infer.py too): TF32 is off while scoring, so only float32 summation order differs
between cuBLAS and the CPU. Probabilities agree to atol 1e-5; the predicted class is the same for every row
except where the CPU's top two probabilities are within 2e-5 of each other (a near-tie may flip); keys, row
order, model version and the output schema are identical.

These run only where CUDA is present (skipped with the reason elsewhere, CI included: its machine has no GPU);
tests/tasks/test_evaluate_infer.py runs the same device path on the CPU against today's exact predictions.
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from stagewise import infer
from stagewise.core import storage
from stagewise.datasets.predictions import plan_inference
from stagewise.definitions.loading import load_config
from stagewise.evaluate import evaluate
from tests.conftest import train_digits_s1

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU scoring tests need one")]

PROBABILITY_ATOL = 1e-5
NEAR_TIE = 2 * PROBABILITY_ATOL


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Digits preprocessed and s1 trained on the CPU (hidden 64); returns (config path, run prefix, model URI)."""
    return train_digits_s1(tmp_path_factory.mktemp("storage"), "cuda", hidden=64)


def _score(config_path, model_uri: str, device: str, out: str, batch_size: int) -> list:
    config = load_config(config_path, {"profiles.small.device": device, "inference.batch_size": batch_size})
    source = storage.resolve(config.storage_root, config.dataset.uri)
    shards = plan_inference(source, rows_per_shard=700)
    return [pq.read_table(infer.score_shard(config, model_uri, shard, out)["uri"]) for shard in shards]  # 700 rows: one file


@pytest.mark.parametrize("batch_size", [1024, 96])
def test_a_shard_scores_the_same_on_the_gpu_as_on_the_cpu(trained, tmp_path, batch_size):
    """Per shard: same keys in the same order, same schema and version; probabilities within 1e-5, classes equal
    but for near-ties; with one chunk per shard and with many (prefetch on the side stream in play)."""
    config_path, _, model_uri = trained
    on_cpu = _score(config_path, model_uri, "cpu", str(tmp_path / "cpu"), batch_size)
    on_gpu = _score(config_path, model_uri, "cuda", str(tmp_path / "gpu"), batch_size)
    assert len(on_cpu) == len(on_gpu) > 1
    for cpu, gpu in zip(on_cpu, on_gpu):
        assert cpu.schema == gpu.schema
        assert cpu.column("row_id").to_pylist() == gpu.column("row_id").to_pylist()
        assert cpu.column("model_version").to_pylist() == gpu.column("model_version").to_pylist()
        p_cpu = np.stack(cpu.column("probabilities").to_numpy(zero_copy_only=False))
        p_gpu = np.stack(gpu.column("probabilities").to_numpy(zero_copy_only=False))
        np.testing.assert_allclose(p_gpu, p_cpu, rtol=0, atol=PROBABILITY_ATOL)
        top2 = np.sort(p_cpu, axis=1)[:, -2:]
        decided = (top2[:, 1] - top2[:, 0]) > NEAR_TIE
        assert decided.mean() > 0.9, "the model must decide most rows, or the class check says nothing"
        classes_cpu, classes_gpu = cpu.column("prediction").to_numpy(), gpu.column("prediction").to_numpy()
        assert np.array_equal(classes_cpu[decided], classes_gpu[decided])


def test_evaluate_on_the_gpu_reports_the_cpus_metrics(trained, tmp_path):
    """evaluate on a cuda profile: the same test rows and accuracy (but for near-ties), loss within float32 error."""
    config_path, out, model_uri = trained
    on_cpu = evaluate(load_config(config_path), model_uri, out)
    on_gpu = evaluate(load_config(config_path, {"profiles.small.device": "cuda"}), model_uri, out)
    assert on_gpu["test_rows"] == on_cpu["test_rows"]
    assert on_gpu["test_accuracy"] == pytest.approx(on_cpu["test_accuracy"], abs=2 / on_cpu["test_rows"])
    assert on_gpu["test_loss"] == pytest.approx(on_cpu["test_loss"], rel=1e-4)


def test_the_gpu_pipeline_scores_a_dirty_shard_of_many_row_groups_as_the_cpu(trained, tmp_path, monkeypatch):
    """The full pipeline on the GPU (the shard cut into three parts, each with a reader thread, a preparing thread
    writing pinned chunks and a writer thread waiting on each chunk's event, its own output file; side-stream copies;
    coalesced row groups) against one thread and one file on the CPU: the same keys in the same order (the GPU's
    files read as its result lists them) and the same quarantine (rows, reasons, shard rows); probabilities within
    1e-5, classes equal but for near-ties; no pipeline thread left behind."""
    import threading

    import pyarrow as pa

    from tests.tasks.test_evaluate_infer import _scattered_dirty_input

    config_path, _, model_uri = trained
    path = _scattered_dirty_input(load_config(config_path), tmp_path)
    shard = plan_inference(path, rows_per_shard=10_000)[0]
    on_cpu = infer.score_shard(load_config(config_path, {"inference.batch_size": 1024}), model_uri, shard,
                               str(tmp_path / "cpu"))
    monkeypatch.setattr(infer, "OUTPUT_ROW_GROUP_ROWS", 200)
    monkeypatch.setattr(infer, "OUTPUT_FILE_ROWS", 300)
    gpu_config = load_config(config_path, {"profiles.small.device": "cuda", "inference.batch_size": 96,
                                           "profiles.small.threads_per_process": 3})
    on_gpu = infer.score_shard(gpu_config, model_uri, shard, str(tmp_path / "gpu"))
    assert not [t.name for t in threading.enumerate() if t.name.startswith("infer-")]
    assert len(on_cpu["files"]) == 1 and len(on_gpu["files"]) == 3
    assert on_gpu["rows"] == on_cpu["rows"] and on_gpu["rows_quarantined"] == on_cpu["rows_quarantined"] > 0
    quarantined = pa.concat_tables([pq.read_table(f["uri"]) for f in on_gpu["quarantine_files"]])
    assert quarantined.equals(pq.read_table(on_cpu["quarantine_uri"]))
    cpu = pq.read_table(on_cpu["uri"])
    gpu = pa.concat_tables([pq.read_table(f["uri"]) for f in on_gpu["files"]])
    assert cpu.schema == gpu.schema
    assert all(pq.ParquetFile(f["uri"]).metadata.num_row_groups > 1 for f in on_gpu["files"])
    assert cpu.column("row_id").to_pylist() == gpu.column("row_id").to_pylist()
    p_cpu = np.stack(cpu.column("probabilities").to_numpy(zero_copy_only=False))
    p_gpu = np.stack(gpu.column("probabilities").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(p_gpu, p_cpu, rtol=0, atol=PROBABILITY_ATOL)
    top2 = np.sort(p_cpu, axis=1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > NEAR_TIE
    assert np.array_equal(cpu.column("prediction").to_numpy()[decided], gpu.column("prediction").to_numpy()[decided])
