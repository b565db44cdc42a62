"""`earlier_step_seconds`: the step times of the newest finished run of the same config, read from a real MLflow
SQLite store, for the ETA's shape of the steps ahead (tests/flows/test_eta.py replays what it does with them)."""

from __future__ import annotations

import time
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric
from session_cache import mlflow_store

from rlstages.configs import RunConfig, config_hash, load_config
from rlstages.tasks.driver.tracking import earlier_step_seconds

ROOT = Path(__file__).resolve().parents[4]


def _cfg(store: str, *more: str) -> RunConfig:
    return load_config(
        ROOT / "configs" / "tiny.yaml",
        [f"tracking.tracking_uri={store}", "tracking.experiment=eta", "trainer.total_steps=3", *more],
    )


def _run(c: MlflowClient, exp: str, digest: str, status: str, step_s: list[float], compile_s: float = 0.0) -> str:
    """A run of config hash `digest` that logged `timing/step_s` for steps 1.. and its first step's compiling."""
    rid = c.create_run(exp, tags={"rlstages.config_hash": digest}).info.run_id
    now = int(time.time() * 1000)
    metrics = [Metric("timing/step_s", s, now, k) for k, s in enumerate(step_s, start=1)]
    metrics += [Metric("perf/compile_s/actor", compile_s, now, 1), Metric("perf/compile_s/actor", 0.0, now, 2)]
    c.log_batch(rid, metrics=metrics)
    c.set_terminated(rid, status)
    time.sleep(0.01)  # distinct start times: the newest is chosen
    return rid


def test_the_newest_finished_run_of_the_same_config_that_timed_every_step(tmp_path: Path) -> None:
    store = mlflow_store(tmp_path)
    cfg = _cfg(store)
    c = MlflowClient(store)
    exp, digest = c.create_experiment("eta"), config_hash(cfg)
    _run(c, exp, digest, "FINISHED", [9.0, 9.0, 9.0])  # older: not chosen
    chosen = _run(c, exp, digest, "FINISHED", [12.0, 8.0, 6.0], compile_s=3.0)
    _run(c, exp, digest, "FINISHED", [10.0, 7.0])  # stopped short of this run's 3 steps
    _run(c, exp, digest, "KILLED", [1.0, 1.0, 1.0])
    _run(c, exp, config_hash(_cfg(store, "trainer.seed=7")), "FINISHED", [2.0, 2.0, 2.0])  # another config
    this = _run(c, exp, digest, "FINISHED", [5.0, 5.0, 5.0])  # the run asking (a resumed one): not its own
    assert earlier_step_seconds(cfg, this) == (12.0 - 3.0, 8.0, 6.0), chosen
    assert earlier_step_seconds(_cfg(store, "trainer.seed=8"), this) == ()  # no run of that config
    assert earlier_step_seconds(_cfg(store, "tracking.experiment=none-yet"), this) == ()
