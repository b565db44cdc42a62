"""Two runs logging the same dataset at the same moment both record it (MLflow's SQL store looks up, then
inserts: the loser of that race got a UNIQUE-constraint error and the run failed)."""

from __future__ import annotations

import threading
from pathlib import Path

from mlflow import MlflowClient
from mlflow.data.code_dataset_source import CodeDatasetSource
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag
from session_cache import mlflow_store

from rlstages.tasks.driver.tracking.runs import log_inputs_once_stored


def test_concurrent_runs_log_one_dataset(tmp_path: Path) -> None:
    c = MlflowClient(mlflow_store(tmp_path))
    exp = c.create_experiment("race")
    barrier, errors, runs = threading.Barrier(2), [], []

    def log(rounds: int = 12) -> None:
        for i in range(rounds):
            rid = c.create_run(exp).info.run_id
            runs.append((rid, f"d{i}"))
            ds = MetaDataset(CodeDatasetSource(tags={"source": "t"}), name=f"train {i}", digest=f"d{i}")  # type: ignore[abstract]
            entity = DatasetInput(ds._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", "train")])
            barrier.wait(timeout=30)
            try:
                log_inputs_once_stored(c, rid, [entity])
            except Exception as e:  # a lost race that was not retried
                errors.append(str(e)[:200])

    threads = [threading.Thread(target=log) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    for rid, digest in runs:
        assert [d.dataset.digest for d in c.get_run(rid).inputs.dataset_inputs] == [digest]
