"""What keeps the flow's per-stage overhead down, checked with real Prefect (no server) and a real MLflow store:
the temporary Prefect server's settings (and that a started server never gets them), a lone concurrent stage
run in the flow's thread as a task run that is still retried on its own, and step logging that asks MLflow
for the last logged step once per run. Seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from rlstages.configs import RunConfig, load_config
from rlstages.configs.stages import StagePolicy
from rlstages.flows import TEMPORARY_SERVER_DEFAULTS
from rlstages.flows.stages import Stage, Stages
from rlstages.tasks.driver import tracking
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.policies import with_policy

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.serial  # owns the machine: its temporary server and thread timings (tests/README.md)


def _flows_env(**env: str) -> dict[str, str]:
    """The environment and TEMPORARY_SERVER_ENV a fresh process sees after importing rlstages.flows."""
    code = (
        "import json, os; from rlstages.flows import TEMPORARY_SERVER_DEFAULTS as D, TEMPORARY_SERVER_ENV as T; "
        "from rlstages.flows.cli.servers import _inherited_env as I; "
        "print(json.dumps({'env': {k: os.environ.get(k) for k in D}, 'ours': T, 'child': {k: I().get(k) for k in D}}))"
    )
    base = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL" and k not in TEMPORARY_SERVER_DEFAULTS}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_temporary_server_runs_no_automations_and_a_started_server_keeps_prefects_defaults() -> None:
    seen = _flows_env()
    assert seen["env"] == TEMPORARY_SERVER_DEFAULTS == seen["ours"]
    assert set(seen["child"].values()) == {None}  # `rlstages server up` starts a real server without them
    mine = _flows_env(PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED="true")  # the user's environment wins
    assert mine["env"]["PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED"] == "true"
    assert mine["child"]["PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED"] == "true"
    assert "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED" not in mine["ours"]
    remote = _flows_env(PREFECT_API_URL="http://127.0.0.1:1/api")  # no temporary server: nothing set
    assert remote["ours"] == {} and set(remote["env"].values()) == {None}


_CALLS: list[tuple[int, str]] = []


@task(name="flaky_reader", cache_policy=NO_CACHE)
def flaky_reader(cfg: RunConfig, run: RunHandle, step: int) -> dict[str, float]:
    """Fails with a transient error on its first call of each step, then returns the thread it ran in."""
    _CALLS.append((step, threading.current_thread().name))
    if sum(s == step for s, _ in _CALLS) == 1:
        raise TimeoutError("transient: a worker call timed out")
    return {"step": float(step)}


def test_a_lone_concurrent_stage_runs_in_the_flows_thread_and_is_retried_on_its_own(prefect_harness) -> None:
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [])
    policy = StagePolicy(retries=1, retry_delay_seconds=0.0, backoff_factor=1.0, jitter_factor=0.0)
    reader = Stage(with_policy(flaky_reader, policy).with_options(task_run_name="flaky_reader[step={step}]"))
    handle = RunHandle("overhead", "/nonexistent")

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=4))  # type: ignore[arg-type]
    def step_flow() -> tuple[list[dict[str, float]], list[dict[str, float]], str]:
        alone = Stages().together([reader], cfg, handle, 1)
        pair = Stages().together([reader, reader], cfg, handle, 2)
        return alone, pair, threading.current_thread().name

    _CALLS.clear()
    alone, pair, flow_thread = step_flow()
    assert alone == [{"step": 1.0}] and pair == [{"step": 2.0}, {"step": 2.0}]
    lone = [name for step, name in _CALLS if step == 1]
    assert lone == [flow_thread, flow_thread]  # failed once, retried, both in the flow's own thread
    assert all(name != flow_thread for step, name in _CALLS if step == 2)  # two at once: the pool's threads


def test_steps_are_logged_once_and_a_new_process_asks_mlflow_where_it_stopped(tmp_path: Path) -> None:
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", "trainer.run_name=overhead"],
    )
    run_id = tracking.start_or_resume(cfg, "overhead", None, None)
    assert [tracking.log_step(cfg, run_id, s, {"reward/mean": s / 10}) for s in (1, 2, 2, 3)] == [1, 1, 0, 1]
    tracking.flush()
    tracking.runs._LAST_STEP.pop(run_id)  # as a new process resuming the run sees it
    assert not tracking.log_step(cfg, run_id, 3, {"reward/mean": 0.0})  # MLflow already has step 3
    assert tracking.log_step(cfg, run_id, 4, {"reward/mean": 0.4})
    tracking.flush()
    history = tracking.client(cfg).get_metric_history(run_id, "reward/mean")
    assert sorted(int(m.step) for m in history) == [1, 2, 3, 4]
