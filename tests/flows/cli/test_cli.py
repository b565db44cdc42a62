"""The `rlstages` command line: one real-process smoke test (`rlstages run` of a 1-step tiny run, then `rlstages
eval` of its checkpoint, both pointed at the session's Ray and Prefect so that they boot none of their own); in
process (typer's CliRunner), `resume` of the session's finished reference run (nothing left to do) and one-line
errors with non-zero exits. CPU only, about a minute."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from flow_support import ROOT, Reference, invoke
from session_cache import mlflow_store


@pytest.fixture(scope="module")
def session_env(ray_session, prefect_harness) -> dict[str, str]:
    """The environment of a CLI process that uses the session's local Ray and Prefect API (no servers of its own)."""
    from prefect.settings import PREFECT_API_URL

    # MLflow: the run's own store in its working directory (an earlier test's set_tracking_uri exports its URI)
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RLSTAGES_FAULTS")}
    return {
        **env,
        "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
    }


def rlstages(*args: str, cwd: Path, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlstages.flows.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**env, "PREFECT_HOME": str(cwd / ".prefect"), "RLSTAGES_FAULTS": ""},
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir: Path, session_env: dict[str, str]) -> Path:
    """`rlstages run` in its own process: one step, the checkpoint evaluated at its end (the 2-step run is the
    session's reference)."""
    work = tmp_path_factory.mktemp("cli")
    mlflow_store(work)  # the default store, ./mlflow.db, from the session's migrated copy
    done = rlstages(
        "run",
        str(ROOT / "configs" / "tiny.yaml"),
        f"model.path={tiny_model_dir}",
        "model.provider=local",
        "trainer.run_name=cli",
        "trainer.total_steps=1",
        "trainer.eval_at_start=false",
        "tracking.log_model=false",
        cwd=work,
        env=session_env,
    )
    log = work / "runs" / "cli.log"
    assert done.returncode == 0, done.stderr[-3000:] + (log.read_text()[-3000:] if log.is_file() else "")
    assert "final policy in" in done.stdout
    (work / "terminal.txt").write_text(done.stdout + done.stderr)  # what the person saw (stdout is not a TTY)
    return work / "runs" / "cli"


def test_the_terminal_shows_ours_alone_and_ends_with_the_summary(finished_run: Path) -> None:
    """Libraries' warnings and progress bars and the Ray workers' output go to the run's log file; the terminal
    has the machine line, one plain line per step and the summary panel."""
    from mlflow import MlflowClient

    shown = (finished_run.parent.parent / "terminal.txt").read_text()
    log = finished_run.parent / "cli.log"
    assert "warning" not in shown.lower() and "traceback" not in shown.lower(), shown
    assert not re.search(r"\d+%\||it/s|s/it", shown), shown  # no tqdm bar (plain mode draws none of ours)
    assert shown.count(f"log: {Path('runs') / 'cli.log'}") == 1, shown
    assert re.search(r"^machine: .+; native bf16 (yes|no) .+; GEMM .+; 1 thread/worker$", shown, re.M), shown
    assert re.search(r"^step 1/1 reward [\d.]+ .* s/step \| ETA \d+:\d\d:\d\d$", shown, re.M), shown
    for row in ("run summary: cli", "held-out accuracy", "→ best", "reward_curve.png", "mlflow ui --backend-store-uri"):
        assert row in shown, (row, shown)
    # the Prefect row: the server the run reported to (this process points at the session's API), else the command
    # that opens the temporary server's database
    assert re.search(r"Prefect UI +(open http://127\.0\.0\.1:\d+|prefect server start)", shown), shown
    kept = log.read_text()
    assert "Loading weights" in kept and "it/s" in kept  # the workers' progress bars went to the log
    run_id = json.loads((finished_run / "run_state.json").read_text())["mlflow_run_id"]
    tags = MlflowClient(f"sqlite:///{finished_run.parent.parent / 'mlflow.db'}").get_run(run_id).data.tags
    assert tags["machine.threads_per_worker"] == "1" and tags["machine.cpu"] in shown and "machine.gemm" in tags


def test_run_writes_the_run_directory(finished_run: Path) -> None:
    assert (finished_run / "final" / "model.safetensors").is_file()
    assert (finished_run / "reward_curve.png").stat().st_size > 1000
    assert (finished_run.parent.parent / "mlflow.db").is_file()


def test_eval_reports_greedy_pass_at_1(finished_run: Path, session_env: dict[str, str]) -> None:
    out = rlstages("eval", str(finished_run), cwd=finished_run.parent.parent, env=session_env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "eval/reward_mean" in out.stdout and "step 1" in out.stdout


def test_resume_of_a_finished_run_is_a_no_op_that_succeeds(reference_run: Reference) -> None:
    run_dir = reference_run.run_dir
    before = (run_dir / "final" / "model.safetensors").read_bytes()
    out = invoke("resume", str(run_dir), cwd=reference_run.tmp)
    assert out.exit_code == 0, (out.stderr[-3000:], out.exception)
    assert "nothing to resume" in out.stdout and "finished" in out.stdout  # nothing started (no flow run)
    assert (run_dir / "final" / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize(
    ("args", "needle", "code"),
    [
        (("run", "configs/nope.yaml"), "no such config file", 2),
        (("run", "configs/tiny.yaml", "rollout.n=one"), "rollout.n: Input should be a valid integer", 2),
        (("resume", "not-a-run"), "not a run directory", 2),
        (("eval", "not-a-run"), "not a run directory", 2),
        (("replay", "not-a-run"), "not-a-run: neither a run directory (with config.yaml) nor a run under runs", 2),
        (  # refused before Ray or Prefect start, with the install command (rich markup must not eat "[sglang]")
            ("run", "configs/tiny.yaml", "rollout.backend=sglang", "cluster.num_gpus=1"),
            "rollout.backend=sglang: package 'sglang' is not installed here; install it with pip install "
            "'rlstages[sglang]'",
            2,
        ),
    ],
)
def test_bad_input_is_one_line_and_non_zero(args: tuple[str, ...], needle: str, code: int, tmp_path: Path) -> None:
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    out = invoke(*args, cwd=tmp_path)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.exit_code == code and len(lines) == 1 and needle in lines[0], out.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()  # nothing created


def test_the_command_line_starts_without_the_heavy_libraries() -> None:
    # `rlstages --help`, a config error or `config show` must not wait for torch, Prefect, MLflow or Ray to import
    # (7 of the 8 s a bad config took before `convert`'s options moved out of the module that imports torch)
    heavy = ("torch", "prefect", "mlflow", "ray", "transformers", "tensordict")
    probe = f"import sys, rlstages.flows.cli.main; print(sorted(set({heavy!r}) & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_start_that_logged_its_port_taken_fails_at_once_and_its_process_group_is_stopped(tmp_path: Path) -> None:
    """A server process group that logged uvicorn's bind error but lingers (MLflow's did past 35 s on a loaded 2-core
    VM) is not waited for: the port-taken line comes within seconds and nothing of the group is left."""
    import socket
    import time

    from rlstages.flows.cli import servers as srv

    with socket.socket() as probe:  # a port nobody listens on: the health polls are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = "echo 'ERROR: [Errno 98] error while attempting to bind: address already in use'; sleep 600"
    log = tmp_path / "lingering-server.log"
    pid, log_from = srv._spawn("lingering", ["sh", "-c", script], log, {})
    url = f"http://127.0.0.1:{port}"
    server = srv.Server("lingering", pid, url, f"{url}/health", str(log), log_from)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"lingering server exited during start-up: {url} is taken"):
        srv.wait_healthy(server, timeout=120)
    assert time.monotonic() - start < 30  # not the 600 s the group would have lingered, nor the bound
    assert not srv.alive(pid)  # the sleeping shell was stopped with its group


def test_a_server_whose_port_was_taken_says_so_and_an_earlier_start_is_not_blamed(tmp_path: Path) -> None:
    """A real MLflow server on a port another socket holds exits at start-up: the line says the port is taken; the
    next start in the same log, failing for another reason (a bad store), does not repeat that."""
    import socket

    from rlstages.flows.cli import servers as srv

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        lines = []
        for backend in (f"sqlite:///{tmp_path / 'mlflow.db'}", "bogus://store"):
            server = srv.start_mlflow(backend, tmp_path / "artifacts", port, log_dir=tmp_path)
            with pytest.raises(RuntimeError) as failed:
                srv.wait_healthy(server, timeout=300)  # a bound: a 2-core AVX2 VM under load took 81 s to bind
            lines.append(str(failed.value))
    assert lines[0] == f"mlflow server exited during start-up: http://127.0.0.1:{port} is taken; see {server.log}"
    assert lines[1] == f"mlflow server exited during start-up; see {server.log}"
    assert "address already in use" in (tmp_path / "mlflow-server.log").read_text().lower()  # the first start's
