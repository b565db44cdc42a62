"""The run directory's tracking journal (tasks/driver/tracking/journal.py, outbox.py) against a real MLflow
SQLite store: a store that does not answer keeps every call journaled, in order; a later process (a resumed
run) sends them, each metric step once; a step whose send was cut off after the store took it is not sent
again. The drills with real servers killed and restarted are tests/integration/test_outages.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric
from session_cache import mlflow_store

from rlstages.engines.utils import free_port
from rlstages.tasks.driver.tracking.journal import Journal
from rlstages.tasks.driver.tracking.outbox import Outbox


def _metrics(step: int, ts: int) -> dict[str, list[list[object]]]:
    return {"metrics": [["reward/mean", step / 10, ts, step], ["progress/step", float(step), ts, step]]}


@pytest.fixture
def store(tmp_path: Path) -> tuple[str, MlflowClient, str]:
    uri = mlflow_store(tmp_path)
    c = MlflowClient(uri)
    return uri, c, c.create_run(c.create_experiment("journal")).info.run_id


def test_calls_wait_in_the_journal_while_mlflow_is_away_and_a_resumed_run_sends_them_once(
    store: tuple[str, MlflowClient, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, c, rid = store
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retry budget, shortened
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    away = Outbox(Journal(tmp_path / "run"), f"http://127.0.0.1:{free_port()}")  # nothing listens there
    for step in (1, 2, 3):
        away.post(rid, "metrics", _metrics(step, 1000 + step), step)
    away.post(rid, "tags", {"tags": {"rlstages.note": "journaled"}})
    away.post(rid, "table", {"data": {"prompt": ["1+1"], "score": [1.0]}, "artifact_file": "eval/t.json"})
    (tmp_path / "manifest.json").write_text("{}")
    kept = away.journal.keep_file(tmp_path / "manifest.json", "manifest.json")
    (tmp_path / "manifest.json").unlink()  # pruned meanwhile: the journal's copy is what is sent
    away.post(rid, "artifact", {"path": kept, "dir": "checkpoints/step_000002"})
    away.post(rid, "terminate", {"status": "FINISHED", "end_time": 5000})
    assert away.flush(30, while_down=False) == 7 and away.down_since is not None
    away.close()
    away.journal.close()

    resumed = Outbox(Journal(tmp_path / "run"), uri)  # the next process, the store reachable
    assert resumed.journal.last_step(rid) == 3  # a replay of steps 1-3 is recognised as logged
    assert resumed.flush(60) == 0
    resumed.close()
    for key in ("reward/mean", "progress/step"):
        assert [m.step for m in c.get_metric_history(rid, key)] == [1, 2, 3], key
    run = c.get_run(rid)
    assert run.info.status == "FINISHED" and run.data.tags["rlstages.note"] == "journaled"
    assert {a.path for a in c.list_artifacts(rid, "checkpoints/step_000002")} == {
        "checkpoints/step_000002/manifest.json"
    }
    assert {a.path for a in c.list_artifacts(rid, "eval")} == {"eval/t.json"}
    assert not any((tmp_path / "run" / "tracking" / "blobs").iterdir())  # sent: the copies are gone


def test_an_attempted_step_the_store_already_holds_is_not_sent_again(
    store: tuple[str, MlflowClient, str], tmp_path: Path
) -> None:
    uri, c, rid = store
    journal = Journal(tmp_path / "run")
    journal.append(rid, "metrics", _metrics(1, 1001), 1)
    journal.append(rid, "metrics", _metrics(2, 1002), 2)
    cut_off, not_arrived = journal.unsent()
    c.log_batch(rid, metrics=[Metric(k, v, ts, s) for k, v, ts, s in cut_off.payload["metrics"]])  # stored ...
    journal.mark(cut_off, "attempted")  # ... but the answer never came back
    journal.mark(not_arrived, "attempted")  # this one never reached the store
    box = Outbox(journal, uri)
    assert box.flush(60) == 0
    box.close()
    assert [m.step for m in c.get_metric_history(rid, "reward/mean")] == [1, 2]
    assert journal.points(rid, "reward/mean") == {1: 0.1, 2: 0.2}


def test_run_metrics_are_logged_at_their_step_once(store: tuple[str, MlflowClient, str]) -> None:
    """`log_run_metrics` (an evaluation's seconds, the run's evaluation share): a replayed evaluation's second
    time is not logged again, and no step entry of the journal is taken for them."""
    from rlstages.configs.loader import load_config
    from rlstages.tasks.driver.tracking import log_run_metrics

    uri, c, rid = store
    cfg = load_config("configs/tiny.yaml", [f"tracking.tracking_uri={uri}"])
    log_run_metrics(cfg, rid, 2, {"time/eval_s": 3.5})
    log_run_metrics(cfg, rid, 2, {"time/eval_s": 4.0, "time/eval_fraction": 0.1})  # step 2 replayed
    assert [(m.step, m.value) for m in c.get_metric_history(rid, "time/eval_s")] == [(2, 3.5)]
    assert [(m.step, m.value) for m in c.get_metric_history(rid, "time/eval_fraction")] == [(2, 0.1)]
