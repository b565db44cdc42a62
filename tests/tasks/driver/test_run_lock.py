"""The run directory's lock (`rlstages.tasks.driver.run_lock`) between real processes: a live holder refuses a
second run in one line naming its host and pid; a holder that died (SIGKILL: no clean-up) leaves a file that blocks
no one. And a fresh SQLite tracking store opened by several processes at once: each opens it (MLflow's migration
of a new database is serialised). CPU only, a few seconds."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlstages.tasks.driver.run_lock import RunInUse, acquire, lock_path, release

HOLD = (
    "import sys; from pathlib import Path; from rlstages.tasks.driver.run_lock import acquire; "
    "acquire(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()"
)


def test_a_live_holder_refuses_and_a_dead_one_does_not(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "demo"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunInUse) as refused:
            acquire(run)
        line = str(refused.value)
        assert "\n" not in line and line.startswith(f"trainer.run_name: {run} is in use by another run")
        assert f"host {socket.gethostname()}, pid {holder.pid}," in line and str(lock_path(run)) in line
        assert not run.exists()  # the refused run touched nothing of the holder's (its directory not created)
        holder.send_signal(signal.SIGKILL)  # a crash: no clean-up, the lock file stays
        holder.wait(timeout=30)
    finally:
        holder.kill()
    assert json.loads(lock_path(run).read_text())["pid"] == holder.pid  # stale: names a process that is gone
    try:
        assert acquire(run) is True  # the stale lock does not block a re-run
        assert acquire(run) is False  # held by this process already: a no-op
        assert json.loads(lock_path(run).read_text())["pid"] == os.getpid()
    finally:
        release(run)
    assert acquire(run) is True  # released: taken again
    release(run)


OPEN_STORE = (
    "import sys; from rlstages.configs import load_config; from rlstages.tasks.driver.tracking import client; "
    "cfg = load_config(sys.argv[1], [f'tracking.tracking_uri=sqlite:///{sys.argv[2]}']); "
    "print(len(client(cfg).search_experiments()))"
)


def test_a_fresh_sqlite_store_opened_by_three_processes_at_once(tmp_path: Path) -> None:
    config = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
    db = tmp_path / "mlflow.db"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN_STORE, str(config), str(db)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "MLFLOW_TRACKING_URI": ""},
        )
        for _ in range(3)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]  # not MLflow's "Online migration expected to match one row"
        assert out.strip() == "1"  # the Default experiment, created once
