"""Scheduled deployments against a real `prefect server` and a real `mlflow server` (tests/integration/conftest.py): a
schedule fires within seconds and completes a short run whose failing stage is retried in place; an overlapping run
is cancelled by the concurrency limit; the next run of a `resume: auto` deployment continues the checkpoint, while a
`resume: fresh` one starts over; a failed run is FAILED in Prefect and in MLflow with the failing stage and error as
tags, and `prefect flow-run retry` resumes it from its checkpoint; finally `rlstages compare` shows those runs side
by side.

The `nightly` deployment's runs join the session's two-node Ray cluster through RAY_ADDRESS, as a serve process on a
Ray head would; the `fresh` deployment's runs keep their engines in the served process (`cluster.mode: in_process`),
as its checks are of Prefect's and MLflow's records. CPU only; a few minutes (five tiny training runs in served
subprocesses): `pytest tests/integration/test_deployments.py`.
"""

from __future__ import annotations

import datetime as dt
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from integration_support import RLSTAGES, PrefectAPI, Servers, base_env, serve, tiny_overrides
from mlflow import MlflowClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]
EXPERIMENT = "it-deployments"
HYBRID = ("cluster.hybrid_engine=true",)  # trainer and rollout in one worker: one actor process less per run


def mlflow_run(servers: Servers, run_name: str) -> Any:
    """The one MLflow run called `run_name` in the test experiment."""
    client = MlflowClient(servers.mlflow_uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    assert exp is not None, f"no MLflow experiment {EXPERIMENT}"
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{run_name}'")
    assert len(runs) == 1, f"expected one MLflow run {run_name}, got {len(runs)}"
    return runs[0]


def steps(servers: Servers, run_id: str, key: str = "reward/mean") -> list[int]:
    """Steps of every logged point of a metric (a step logged twice shows twice)."""
    return sorted(int(m.step) for m in MlflowClient(servers.mlflow_uri).get_metric_history(run_id, key))


def task_count(api: PrefectAPI, flow_run_id: str, task: str) -> int:
    """How many task runs of `task` the flow run made (each retry of a task run counts once)."""
    return sum(
        1
        for t in api.task_runs(flow_run_id)
        if t["task_key"].startswith(f"{task}-") or t["name"].startswith(f"{task}-")
    )


@pytest.fixture(scope="module")
def nightly(
    servers: Servers, prefect_api: PrefectAPI, ray_cluster, tiny_model_dir: Path, tmp_path_factory
) -> dict[str, Any]:
    """Serve `nightly` (resume auto, 1 step, interval schedule whose first tick is ~45 s away, cancel on
    overlap, a transient fault at generate@1); record the scheduled run, an overlapping manual run, and the
    next run after it.
    """
    tmp = tmp_path_factory.mktemp("nightly")
    anchor = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=45)).replace(microsecond=0, tzinfo=None)
    overrides = tiny_overrides(
        tmp, tiny_model_dir, servers.mlflow_uri, "nightly", EXPERIMENT, *HYBRID, "trainer.total_steps=1"
    )
    args = ["--interval", "3600", "--anchor", anchor.isoformat(), "--heartbeat", "30", "--crash-after", "120"]
    served = serve(prefect_api, servers, ray_cluster.address, tmp, "nightly", overrides, args, "generate@1:transient")
    dep_id = served.deployment["id"]
    try:
        deadline = time.monotonic() + 240
        scheduled: dict[str, Any] | None = None
        while scheduled is None and time.monotonic() < deadline:
            running = [r for r in prefect_api.runs_of(dep_id) if r["state_type"] not in {"SCHEDULED", "PENDING"}]
            scheduled = running[0] if running else None
            time.sleep(2)
        assert scheduled is not None, f"the schedule did not fire:\n{served.tail()}"
        manual = prefect_api.create_run(dep_id)  # overlaps the scheduled run: the limit of 1 cancels it
        overlapped = prefect_api.wait_final(manual["id"], timeout=120)
        first = prefect_api.wait_final(scheduled["id"])
        record = {"state": mlflow_run(servers, "nightly").info.status}
        second = prefect_api.wait_final(prefect_api.create_run(dep_id)["id"])  # what the next tick does
    finally:
        served.stop()
    return {
        "deployment": prefect_api.deployment("nightly"),
        "anchor": anchor,
        "first": first,
        "overlapped": overlapped,
        "second": second,
        "mlflow_after_first": record,
        "run_dir": tmp / "runs" / "nightly",
        "log": served.tail(),
    }


def test_schedule_fires_and_completes_a_run_with_a_retried_stage(nightly, prefect_api, servers) -> None:
    first = nightly["first"]
    assert first["state_type"] == "COMPLETED", nightly["log"]
    assert "auto-scheduled" in first["tags"] and "rlstages" in first["tags"]
    expected = dt.datetime.fromisoformat(first["expected_start_time"]).replace(tzinfo=None)
    assert abs((expected - nightly["anchor"]).total_seconds()) < 1  # the first tick of --interval/--anchor
    generate = [t for t in prefect_api.task_runs(first["id"]) if t["name"] == "generate[step=1]"]
    assert len(generate) == 1 and generate[0]["run_count"] == 2  # failed once, retried in place, completed
    assert generate[0]["state_type"] == "COMPLETED"
    assert nightly["mlflow_after_first"]["state"] == "FINISHED"
    run = mlflow_run(servers, "nightly")
    assert steps(servers, run.info.run_id) == [1]


def test_overlapping_run_is_cancelled_by_the_concurrency_limit(nightly) -> None:
    limit = nightly["deployment"]["global_concurrency_limit"]
    assert limit["limit"] == 1
    assert nightly["deployment"]["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
    assert nightly["overlapped"]["state_type"] == "CANCELLED"
    assert "concurrency" in (nightly["overlapped"]["state"]["message"] or "").lower()


def test_heartbeats_are_sent_and_silent_runs_would_be_marked_crashed(nightly, prefect_api) -> None:
    beats = prefect_api.events("prefect.flow-run.heartbeat", f"prefect.flow-run.{nightly['first']['id']}")
    assert beats, "the served run sent no heartbeat"
    related = {r["prefect.resource.id"] for r in beats[0]["related"]}
    assert "prefect.tag.rlstages" in related  # what the zombie automation matches on
    found = prefect_api.post("automations/filter", {}).json()
    zombie = [a for a in found if a["name"].startswith("rlstages: mark silent")]
    assert len(zombie) == 1
    trigger = zombie[0]["trigger"]
    assert trigger["posture"] == "Proactive" and trigger["within"] == 120
    assert trigger["after"] == ["prefect.flow-run.heartbeat"]
    assert zombie[0]["actions"][0]["type"] == "change-flow-run-state" and zombie[0]["actions"][0]["state"] == "CRASHED"


def test_next_run_with_resume_auto_continues_the_checkpoint(nightly, prefect_api, servers) -> None:
    second = nightly["second"]
    assert second["state_type"] == "COMPLETED", nightly["log"]
    run = mlflow_run(servers, "nightly")  # the same MLflow run, reattached by the second flow run
    assert run.info.status == "FINISHED"
    assert run.data.tags["rlstages.prefect_flow_run_id"] == second["id"]
    assert steps(servers, run.info.run_id) == [1]  # resumed at the last checkpoint: nothing re-trained
    assert task_count(prefect_api, second["id"], "update_actor") == 0
    assert sorted(p.name for p in (nightly["run_dir"] / "checkpoints").glob("step_*")) == ["step_000001"]


@pytest.fixture(scope="module")
def fresh(
    servers: Servers, prefect_api: PrefectAPI, ray_cluster, tiny_model_dir: Path, tmp_path_factory
) -> dict[str, Any]:
    """Serve `fresh` (resume fresh, 2 steps, `checkpoint@2:fatal`): run 1 fails after step 2's metrics, run 2
    starts over (and fails the same way), then `prefect flow-run retry` of run 1 resumes it.
    """
    tmp = tmp_path_factory.mktemp("fresh")
    overrides = tiny_overrides(
        tmp,
        tiny_model_dir,
        servers.mlflow_uri,
        "fresh",
        EXPERIMENT,
        "cluster.mode=in_process",  # Prefect's and MLflow's records are the point here; `nightly` runs on Ray
        "trainer.total_steps=2",
        "checkpoint.resume=fresh",
    )
    served = serve(prefect_api, servers, ray_cluster.address, tmp, "fresh", overrides, [], "checkpoint@2:fatal")
    dep_id = served.deployment["id"]
    try:
        failed = prefect_api.wait_final(prefect_api.create_run(dep_id)["id"])
        failed_name = f"fresh-{failed['id'][:8]}"
        run = mlflow_run(servers, failed_name)
        at_failure = {"status": run.info.status, "tags": dict(run.data.tags)}
        second = prefect_api.wait_final(prefect_api.create_run(dep_id)["id"])
        retry = subprocess.run(
            [str(Path(RLSTAGES).parent / "prefect"), "flow-run", "retry", failed["id"]],
            env=base_env(PREFECT_API_URL=servers.prefect_api, PREFECT_HOME=str(tmp / "prefect-client")),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert retry.returncode == 0, retry.stdout + retry.stderr
        retried = prefect_api.wait(
            failed["id"],
            lambda r: r["run_count"] >= 2 and r["state_type"] in {"COMPLETED", "FAILED", "CRASHED"},
            420,
            "the retried flow run to finish",
        )
    finally:
        served.stop()
    return {
        "failed": failed,
        "failed_name": failed_name,
        "at_failure": at_failure,
        "second": second,
        "retried": retried,
        "runs": tmp / "runs",
        "log": served.tail(),
    }


def test_failed_run_is_failed_in_prefect_and_mlflow_with_the_stage(fresh) -> None:
    assert fresh["failed"]["state_type"] == "FAILED", fresh["log"]
    assert "injected fatal fault" in fresh["failed"]["state"]["message"]
    assert fresh["at_failure"]["status"] == "FAILED"
    assert fresh["at_failure"]["tags"]["rlstages.failed_stage"] == "checkpoint"
    assert "injected fatal fault in checkpoint at step 2" in fresh["at_failure"]["tags"]["rlstages.error"]


def test_next_run_with_resume_fresh_starts_over(fresh, servers) -> None:
    second = fresh["second"]
    assert second["state_type"] == "FAILED"  # the same fault fires in its own new run directory
    second_name = f"fresh-{second['id'][:8]}"
    assert (fresh["runs"] / second_name / "checkpoints" / "step_000001").is_dir()
    first_run = mlflow_run(servers, fresh["failed_name"])
    second_run = mlflow_run(servers, second_name)
    assert second_run.info.run_id != first_run.info.run_id
    assert steps(servers, second_run.info.run_id) == [1, 2]  # trained from step 1, not from run 1's checkpoint


def test_prefect_retry_of_the_failed_run_resumes_from_its_checkpoint(fresh, prefect_api, servers) -> None:
    retried = fresh["retried"]
    assert retried["state_type"] == "COMPLETED", fresh["log"]
    assert retried["id"] == fresh["failed"]["id"] and retried["run_count"] == 2
    # step 1 and 2 in the failed attempt, then only step 2 again: resumed from checkpoint 1, not from scratch
    assert task_count(prefect_api, retried["id"], "update_actor") == 3
    run = mlflow_run(servers, fresh["failed_name"])
    assert run.info.status == "FINISHED"
    assert steps(servers, run.info.run_id) == [1, 2]  # each step logged once
    assert "rlstages.failed_stage" in run.data.tags  # the earlier failure stays on record


def test_compare_shows_the_runs_side_by_side(nightly, fresh, servers, tmp_path) -> None:
    import typer
    from typer.testing import CliRunner

    from rlstages.flows.cli.compare import compare_command

    app = typer.Typer()
    app.command()(compare_command)
    png = tmp_path / "curves.png"
    result = CliRunner().invoke(
        app, [EXPERIMENT, "--tracking-uri", servers.mlflow_uri, "--png", str(png)], env={"COLUMNS": "400"}
    )
    assert result.exit_code == 0, result.output
    rows = {}
    for line in result.output.splitlines():
        cells = [c.strip() for c in line.strip().strip("│┃").split("│")]
        if len(cells) > 1 and cells[0]:
            rows[cells[0]] = cells[1:]
    assert rows["trainer.total_steps"] == ["1", "2", "2"], result.output  # oldest first: nightly, fresh 1, 2
    assert rows["checkpoint.resume"] == ["auto", "fresh", "fresh"]
    assert rows["status"] == ["FINISHED", "FINISHED", "FAILED"]
    assert rows["steps"] == ["1", "2", "2"]
    assert rows["failed_stage"] == ["-", "checkpoint", "checkpoint"]
    assert "trainer.seed" not in rows  # only keys that differ are listed
    assert f"{servers.mlflow_uri}/#/compare-runs?runs=" in result.output
    assert png.is_file() and png.stat().st_size > 5000


def test_deploy_refuses_contradictory_options() -> None:
    from rlstages.flows.cli.deploy import Overlap, concurrency_limit, schedules_for, serve_training

    with pytest.raises(ValueError, match="not both"):
        schedules_for("0 2 * * *", 3600)
    with pytest.raises(ValueError, match="needs --interval"):
        schedules_for(None, None, dt.datetime(2030, 1, 1))
    (cron,) = schedules_for("0 2 * * *", None, timezone="Europe/Paris")
    assert cron.cron == "0 2 * * *" and cron.timezone == "Europe/Paris"
    assert concurrency_limit(Overlap.enqueue).collision_strategy.value == "ENQUEUE"
    with pytest.raises(ValueError, match="at least 30"):
        serve_training(None, "x", [], heartbeat=10)  # type: ignore[arg-type]  # refused before anything starts
    with pytest.raises(ValueError, match="must exceed"):
        serve_training(None, "x", [], heartbeat=60, crash_after=60)  # type: ignore[arg-type]
