"""Signals and run names on the real training flow (tiny random model, engines in the driver, the session's
Prefect API, a real MLflow SQLite store): SIGTERM during an update with `trainer.checkpoint_on_signal` commits a
checkpoint at the step's boundary, stops (exit 143, one line saying what was kept, MLflow KILLED, the Prefect flow
run Cancelled, no process left) and the resumed run ends bit for bit where the uninterrupted reference run ends; a
Ctrl-C or a SIGTERM to the whole process group of a run as `rlstages run` starts it (Ray actors, its own temporary
Prefect server) stops it at once, MLflow KILLED, the flow run Cancelled, nothing left running; Ctrl-C stops at once
and says that nothing was kept; two runs under one name started at once: one runs, the other is refused in one line
(exit 2) and touches nothing of it. The signals are real (`RLSTAGES_FAULTS`: the flow process sends them to itself,
or to its process group, at a stage of a step)."""

from __future__ import annotations

import os
import shlex
import signal
import sqlite3
from contextlib import closing
from pathlib import Path
from uuid import UUID

import pytest
from flow_support import (
    IN_DRIVER,
    ROOT,
    Reference,
    cli,
    final_weights,
    mlflow_run,
    overrides,
    reward_steps,
    run_dir,
    same,
    start_cli,
    wait_cli,
)
from typer.testing import CliRunner

from rlstages.configs import RunConfig, load_config
from rlstages.flows.train import rl_post_train
from rlstages.tasks.driver.checkpoints import latest_checkpoint
from rlstages.tasks.driver.context import RunHandle


def _drill(tmp: Path, model_dir: Path, name: str, *extra: str, on_ray: bool = False) -> tuple[list[str], RunConfig]:
    """drill.yaml (tiny.yaml) in `tmp`, and the overrides of a run named `name` with the engines in the driver (on
    Ray actors with `on_ray`)."""
    (tmp / "drill.yaml").write_text((ROOT / "configs" / "tiny.yaml").read_text())
    args = overrides(tmp, model_dir, name, *(() if on_ray else (IN_DRIVER,)), *extra)
    return args, load_config(tmp / "drill.yaml", args)


def _api() -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {"PREFECT_API_URL": str(PREFECT_API_URL.value())}  # the session's Prefect API: no server of their own


def test_sigterm_in_an_update_commits_at_the_step_boundary_and_the_resume_ends_bitwise(
    reference_run: Reference, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from prefect import get_client

    args, cfg = _drill(tmp_path, tiny_model_dir, "termed", "checkpoint.every=0", "trainer.checkpoint_on_signal=true")
    stopped = cli(tmp_path, "run", "drill.yaml", *args, env={**_api(), "RLSTAGES_FAULTS": "update_actor@1:sigterm"})
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    again = shlex.join(["rlstages", "run", "drill.yaml", *args])
    line = f"stopped after step 1 of 2 (SIGTERM); last checkpoint: step 1; `{again}` resumes from it"
    assert line in stopped.stderr.splitlines(), stopped.stderr[-3000:]
    assert not stopped.left_behind, stopped.left_behind  # no process of the run outlived it
    found = latest_checkpoint(RunHandle("termed", str(run_dir(cfg))), verify=True)
    assert found is not None and found[0] == 1  # checkpoint.every=0: the signal's checkpoint, committed and intact
    _, killed = mlflow_run(cfg)
    assert killed.info.status == "KILLED" and reward_steps(cfg) == [1]
    flow_run = get_client(sync_client=True).read_flow_run(UUID(killed.data.tags["rlstages.prefect_flow_run_id"]))
    assert flow_run.state is not None and flow_run.state.is_cancelled(), flow_run.state
    rl_post_train(cfg)  # the re-run, here (its lock is stale: the stopped process is gone) resumes from step 1
    _, finished = mlflow_run(cfg)
    assert finished.info.status == "FINISHED" and finished.info.run_id == killed.info.run_id
    assert reward_steps(cfg) == [1, 2]
    assert same(final_weights(reference_run.cfg), final_weights(cfg))


# serial: Ray's own fixed limits (30 s for a new raylet to register, 60 s before a driver whose GCS is gone exits)
# were crossed under the parallel tier's load on 2 cores (2026-12-02), failing both drills for a reason not theirs
@pytest.mark.serial
@pytest.mark.timeout(300)  # a regression hangs (the run waited on a dead API): fail in minutes
@pytest.mark.parametrize("fault", ["sigint-group", "sigterm-group"])
def test_a_signal_to_the_process_group_of_a_run_on_ray_stops_it_and_leaves_no_process(
    fault: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """As `rlstages run` is used: the workers Ray actors, Prefect a temporary server of the run's own, and the signal
    sent to the run's whole process group. `ray.init` sets its own SIGTERM handler (`sys.exit`) in the driver; the
    flow's must stay in place (it did not: the flow crashed, MLflow's run was left RUNNING and the temporary server
    outlived the run).
    - `sigint-group`, a Ctrl-C at a terminal: the temporary server got it too and stopped at once, and the run,
      stopping, waited on its API for minutes. It now starts with SIGINT blocked, as Ray's processes do.
    - `sigterm-group` (`timeout`, `kill -- -PGID`, a systemd unit's stop): Ray's processes and the server end with the
      driver. The run waited a minute on Ray's GCS, then Ray's own watchdog ended it (exit 1, no line, processes
      left); now the workers are known gone (`ray_gone`) and the server is started again on its database.
    Either way the flow run is Cancelled in the run's own server's database."""
    signum = signal.SIGINT if fault.startswith("sigint") else signal.SIGTERM
    args, cfg = _drill(tmp_path, tiny_model_dir, fault, on_ray=True)
    stopped = cli(tmp_path, "run", "drill.yaml", *args, env={"RLSTAGES_FAULTS": f"generate@2:{fault}"})
    assert stopped.returncode == 128 + signum, stopped.stderr[-3000:]
    said = [x for x in stopped.stderr.splitlines() if x.startswith(f"stopped at step 2 of 2 ({signum.name}); ")]
    assert said and "last checkpoint: step 1;" in said[0], stopped.stderr[-3000:]
    assert not stopped.left_behind, stopped.left_behind  # Ray's processes and the Prefect server included
    _, killed = mlflow_run(cfg)
    assert killed.info.status == "KILLED" and reward_steps(cfg) == [1], killed.info.status
    assert "rlstages.prefect_flow_run_id" in killed.data.tags
    with closing(sqlite3.connect(tmp_path / ".prefect" / "prefect.db")) as db:  # the run's own server's database
        (state,) = db.execute("SELECT state_type FROM flow_run WHERE name = ?", (fault,)).fetchone()
    assert state == "CANCELLED", state
    log = (cfg.trainer.output_dir / f"{fault}.log").read_text()
    restarted = "the Ray cluster no longer answers" in log and "starting it again to record the run's end" in log
    assert restarted == (signum == signal.SIGTERM), log[-3000:]  # a Ctrl-C leaves both up


def test_ctrl_c_stops_at_once_and_says_that_nothing_was_kept(
    tiny_model_dir: Path, tmp_path: Path, prefect_harness
) -> None:
    from rlstages.flows.cli.main import app

    args, cfg = _drill(tmp_path, tiny_model_dir, "interrupted", "checkpoint.every=0")
    old = Path.cwd()
    os.chdir(tmp_path)
    try:  # in this process: the signal handlers are the flow's while it runs, Python's default after
        result = CliRunner().invoke(
            app, ["run", "drill.yaml", *args], env={"RLSTAGES_FAULTS": "update_actor@2:sigint", "COLUMNS": "2000"}
        )
    finally:
        os.chdir(old)
    assert result.exit_code == 128 + signal.SIGINT, (result.output, result.exception)
    assert "stopped at step 2 of 2 (SIGINT); last checkpoint: none, a re-run starts over" in result.stderr.splitlines()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _, run = mlflow_run(cfg)
    assert run.info.status == "KILLED" and reward_steps(cfg) == [1]
    assert latest_checkpoint(RunHandle("interrupted", str(run_dir(cfg)))) is None


def test_two_runs_under_one_name_started_at_once_one_runs(
    tiny_model_dir: Path, tmp_path: Path, prefect_harness
) -> None:
    """Not on the reference run's xdist worker (load-balanced): the winner's run is checked by its own records."""
    args, cfg = _drill(tmp_path, tiny_model_dir, "twice")
    procs = [start_cli(tmp_path, "run", "drill.yaml", *args, env=_api(), tag=tag) for tag in ("-a", "-b")]
    runs = [wait_cli(proc, tmp_path, tag) for proc, tag in zip(procs, ("-a", "-b"), strict=True)]
    assert sorted(r.returncode for r in runs) == [0, 2], [r.stderr[-2000:] for r in runs]
    winner, loser = sorted(runs, key=lambda r: r.returncode)
    winner_pid = procs[runs.index(winner)].pid
    lines = [x for x in loser.stderr.splitlines() if x.strip() and not x.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith(f"error: trainer.run_name: {run_dir(cfg)} is in use"), lines
    assert f", pid {winner_pid}," in lines[0] and "log:" not in loser.stdout + loser.stderr  # refused before its log
    _, run = mlflow_run(cfg)  # one MLflow run, every step once
    assert run.info.status == "FINISHED" and reward_steps(cfg) == [1, 2]
    assert (run_dir(cfg) / "final" / "model.safetensors").is_file()
    found = latest_checkpoint(RunHandle("twice", str(run_dir(cfg))), verify=True)
    assert found is not None and found[0] == 2  # its checkpoints intact (checksums verified)
    log = (cfg.trainer.output_dir / "twice.log").read_text()
    assert log.count("==== ") == 1  # the loser never opened the run's log


def test_a_signal_during_a_ray_wait_is_still_the_runs_own_stop(ray_session, tmp_path: Path) -> None:
    """Most of a run on Ray is the driver waiting in `ray.get`, and Ray re-raises whatever a signal handler raised
    there as a plain KeyboardInterrupt. The flow still takes it as its stop (Cancelled, exit 143, the line saying
    what was kept), not as a crash: found with a real SIGTERM to `rlstages run` of the demo between steps (MLflow
    KILLED with "KeyboardInterrupt", Prefect Crashed, exit 130, no line)."""
    import threading
    import time

    from rlstages.flows.interrupts import StopOnSignal

    @ray_session.remote(num_cpus=0)
    def wait() -> None:
        time.sleep(60)

    ref = wait.remote()
    stop = StopOnSignal(graceful=False).install()
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt) as caught:
            ray_session.get(ref, timeout=120)
    finally:
        timer.cancel()
        timer.join()
        stop.restore()
        ray_session.cancel(ref, force=True)
    assert type(caught.value) is KeyboardInterrupt  # Ray's, not the handler's `Interrupted`: the case guarded here
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"trainer.output_dir={tmp_path}", "trainer.run_name=waited"])
    run = RunHandle("waited", str(run_dir(cfg)))
    stopped = stop.stopped(caught.value, cfg, run, 2)
    assert stopped is not None and stopped.signum == signal.SIGTERM and not stopped.done
    assert (
        stopped.line()
        == f"stopped at step 2 of {cfg.trainer.total_steps} (SIGTERM); last checkpoint: none, a re-run starts over"
    )
    assert StopOnSignal(graceful=False).stopped(KeyboardInterrupt(), cfg, run, 2) is None
