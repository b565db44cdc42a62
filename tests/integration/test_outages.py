"""Outage drills: the MLflow server, then the Prefect server, SIGKILLed during an 8-step `rlstages run` and
restarted on the same store and port after longer than its client's retry budget (shortened here with the
clients' own settings: MLFLOW_HTTP_REQUEST_MAX_RETRIES / _BACKOFF_FACTOR / _TIMEOUT, PREFECT_CLIENT_MAX_RETRIES).
Training goes on while the server is away (steps are journaled in the run directory meanwhile), the run exits 0,
the MLflow run is FINISHED with every metric step 1..8 exactly once, the flow run is Completed with every step's
task runs. The killable servers are this module's own (one MLflow, one Prefect, 127.0.0.1, free ports, started
once, stopped by PID); each drill kills one and uses the other as it is. CPU only, about 3-5 minutes."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from integration_support import RLSTAGES, TINY, PrefectAPI, base_env, tiny_overrides
from mlflow import MlflowClient
from session_cache import mlflow_store

from rlstages.engines.utils import free_port
from rlstages.flows.cli import servers as srv

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]
STEPS = 8
AWAY_S = 20.0  # the server stays away at least this long: several times the shortened retry budgets below
SHORT_RETRIES = {  # a refused connection gives up after ~3 s (MLflow) / ~2 s (Prefect); a slow answer waits 10 s
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "PREFECT_CLIENT_MAX_RETRIES": "1",
}


@dataclass
class Killable:
    """A server this module started: killed (SIGKILL to its process group) and started again on the same store
    and port."""

    server: srv.Server
    start: object  # () -> srv.Server

    def kill(self) -> None:
        """SIGKILL the whole server (no clean shutdown), and wait until it is gone."""
        os.killpg(self.server.pid, signal.SIGKILL)
        assert srv.stop(self.server.pid, grace=5), f"{self.server.name} server survived SIGKILL"

    def restart(self) -> None:
        """Start it again (same store, same port) and wait for its health endpoint."""
        self.server = self.start()  # type: ignore[operator]
        srv.wait_healthy(self.server, timeout=240)


@pytest.fixture(scope="module")
def killable(session_tmp: Path) -> Iterator[dict[str, Killable]]:
    """One MLflow server (SQLite store) and one Prefect server (SQLite in its PREFECT_HOME) for the drills."""
    root = session_tmp / "outage-servers"
    mlflow_store(root)  # a migrated empty store (session_cache.py): the first start runs no migrations
    backend = f"sqlite:///{root / 'mlflow.db'}"
    started: dict[str, Killable] = {}
    try:
        for attempt in range(3):  # a port free when picked can be some other process's by the time a server binds it
            ml_port, pf_port = free_port(), free_port()
            starts = {
                "mlflow": lambda p=ml_port: srv.start_mlflow(backend, root / "mlartifacts", p, log_dir=root),
                "prefect": lambda p=pf_port: srv.start_prefect(root / "prefect-home", p, ui=False),
            }
            started = {name: Killable(start(), start) for name, start in starts.items()}
            try:
                for k in started.values():
                    srv.wait_healthy(k.server, timeout=240)
                break
            except RuntimeError as exc:
                for k in started.values():
                    srv.stop(k.server.pid, grace=10)
                if "is taken" not in str(exc) or attempt == 2:  # `wait_healthy`'s line for a port lost to a race
                    raise
        yield started
    finally:
        for k in started.values():
            srv.stop(k.server.pid, grace=10)
        assert not [k.server.name for k in started.values() if srv.alive(k.server.pid)]


def _trained_step(log: Path) -> int:
    """The newest step the run has printed (`step N/M ...` lines of its output)."""
    steps = re.findall(r"^step (\d+)/\d+ ", log.read_text(errors="replace"), flags=re.M)
    return max(map(int, steps), default=0)


def _wait_step(proc: subprocess.Popen[bytes], log: Path, step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _trained_step(log) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the run did not reach step {step}:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.5)


def _drill(victim: Killable, other: Killable, tmp: Path, model_dir: Path, name: str) -> tuple[Path, str]:
    """Start the run, kill `victim` once step 2 is logged, keep it away for AWAY_S and until step 5 is trained,
    restart it; returns the run directory and the run's output. The run must exit 0."""
    ml = victim if victim.server.name == "mlflow" else other
    pf = victim if victim.server.name == "prefect" else other
    extra = [f"trainer.total_steps={STEPS}", "checkpoint.every=2", "checkpoint.keep=4", "trainer.eval_every=4"]
    extra += ["cluster.mode=in_process"]
    cmd = [RLSTAGES, "run", TINY, *tiny_overrides(tmp, model_dir, ml.server.api_url, name, f"outage-{name}", *extra)]
    env = base_env(PREFECT_API_URL=pf.server.api_url, PREFECT_HOME=str(tmp / "prefect-client"), **SHORT_RETRIES)
    log = tmp / f"{name}.log"
    run_dir = tmp / "runs" / name
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_step(proc, log, 2, 400)
        victim.kill()
        away = time.monotonic()
        _wait_step(proc, log, 5, 300)  # training goes on without the server
        time.sleep(max(0.0, AWAY_S - (time.monotonic() - away)))
        assert proc.poll() is None or proc.returncode == 0, log.read_text(errors="replace")[-4000:]
        victim.restart()
        rc = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            srv.stop(proc.pid, grace=5)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    return run_dir, text


# `make test`'s integration tier: this drill runs beside the servers' tests (with its own `killable` servers, set
# up once more there), the other two after the simulated cluster's; so neither worker waits on all three at the end
@pytest.mark.xdist_group("servers")
def test_mlflow_down_longer_than_its_retries_then_back(
    killable: dict[str, Killable], tiny_model_dir: Path, tmp_path: Path
) -> None:
    run_dir, text = _drill(killable["mlflow"], killable["prefect"], tmp_path, tiny_model_dir, "mlflow-away")
    c = MlflowClient(killable["mlflow"].server.api_url)
    rid = json.loads((run_dir / "run_state.json").read_text())["mlflow_run_id"]
    run = c.get_run(rid)
    assert run.info.status == "FINISHED"
    for key in ("reward/mean", "progress/step", "actor/pg_loss"):
        assert [m.step for m in c.get_metric_history(rid, key)] == list(range(1, STEPS + 1)), key
    assert [m.step for m in c.get_metric_history(rid, "eval/reward_mean")] == [4, 8]
    manifest = json.loads((run_dir / "checkpoints" / "step_000004" / "manifest.json").read_text())
    assert manifest["tracking_unsent"] > 0  # committed while MLflow was away: the steps waited in the journal
    run_log = run_dir.with_name(f"{run_dir.name}.log").read_text(errors="replace")
    assert "does not answer" in run_log + text  # the run said where its tracking waits
    artifacts = {a.path for a in c.list_artifacts(rid, "checkpoints")}
    assert "checkpoints/step_000004" in artifacts  # the manifest journaled during the outage was uploaded after


def test_prefect_down_longer_than_its_retries_then_back(
    killable: dict[str, Killable], tiny_model_dir: Path, tmp_path: Path
) -> None:
    run_dir, _ = _drill(killable["prefect"], killable["mlflow"], tmp_path, tiny_model_dir, "prefect-away")
    c = MlflowClient(killable["mlflow"].server.api_url)
    rid = json.loads((run_dir / "run_state.json").read_text())["mlflow_run_id"]
    assert c.get_run(rid).info.status == "FINISHED"
    assert [m.step for m in c.get_metric_history(rid, "reward/mean")] == list(range(1, STEPS + 1))
    api = PrefectAPI(killable["prefect"].server.api_url)
    flow_run_id = c.get_run(rid).data.tags["rlstages.prefect_flow_run_id"]
    flow_run = api.wait_final(flow_run_id, timeout=120)
    assert flow_run["state_type"] == "COMPLETED", flow_run["state_name"]
    deadline = time.monotonic() + 60  # the task runs' states arrive as events: the server records them shortly
    while True:
        names = {t["name"]: t["state_type"] for t in api.task_runs(flow_run_id)}
        wanted = [f"{stage}[step={s}]" for stage in ("generate", "update_actor") for s in range(1, STEPS + 1)]
        if all(names.get(w) == "COMPLETED" for w in wanted) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert {w: names.get(w) for w in wanted} == dict.fromkeys(wanted, "COMPLETED")


def test_mlflow_still_away_at_the_end_a_rerun_sends_what_was_journaled(
    killable: dict[str, Killable], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`tracking.outage_wait_s` runs out before MLflow returns: the run ends (exit 0, its steps kept in the
    journal, which checkpoint manifests count); a re-run of the same run, MLflow back, sends them in order."""
    ml, pf = killable["mlflow"], killable["prefect"]
    name, extra = "mlflow-gone", ["trainer.total_steps=4", "checkpoint.every=2", "tracking.outage_wait_s=2"]
    cmd = [RLSTAGES, "run", TINY, *tiny_overrides(tmp_path, tiny_model_dir, ml.server.api_url, name, "outage-gone")]
    cmd += [*extra, "cluster.mode=in_process"]
    env = base_env(PREFECT_API_URL=pf.server.api_url, PREFECT_HOME=str(tmp_path / "prefect-client"), **SHORT_RETRIES)
    run_dir, log = tmp_path / "runs" / name, tmp_path / f"{name}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        _wait_step(proc, log, 1, 400)
        ml.kill()
        rc = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            srv.stop(proc.pid, grace=5)
        if not srv.alive(ml.server.pid):
            ml.restart()
    assert rc == 0, log.read_text(errors="replace")[-4000:]
    with sqlite3.connect(run_dir / "tracking" / "journal.sqlite") as db:
        (unsent,) = db.execute("SELECT COUNT(*) FROM entries WHERE state != 'sent'").fetchone()
    assert unsent > 0
    manifest = json.loads((run_dir / "checkpoints" / "step_000004" / "manifest.json").read_text())
    assert manifest["tracking_unsent"] > 0
    rid = json.loads((run_dir / "run_state.json").read_text())["mlflow_run_id"]
    c = MlflowClient(ml.server.api_url)
    assert [m.step for m in c.get_metric_history(rid, "reward/mean")] != [1, 2, 3, 4]  # not all there yet
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert c.get_run(rid).info.status == "FINISHED"
    for key in ("reward/mean", "progress/step"):
        assert [m.step for m in c.get_metric_history(rid, key)] == [1, 2, 3, 4], key
    with sqlite3.connect(run_dir / "tracking" / "journal.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM entries WHERE state != 'sent'").fetchone() == (0,)
