"""The `rlstages` command line end to end in subprocesses: a tiny run, `eval` of its checkpoint, `resume` of a
finished run (nothing left to do), and one-line errors with non-zero exits. CPU only, ~2 minutes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def rlstages(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREFECT_HOME": str(cwd / ".prefect")}
    return subprocess.run(
        [sys.executable, "-m", "rlstages.flows.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir: Path) -> Path:
    work = tmp_path_factory.mktemp("cli")
    done = rlstages(
        "run",
        str(ROOT / "configs" / "tiny.yaml"),
        f"model.path={tiny_model_dir}",
        "model.provider=local",
        "trainer.run_name=cli",
        "tracking.log_model=false",
        cwd=work,
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
    assert re.search(r"^step 2/2 reward [\d.]+ .* s/step \| ETA \d+:\d\d:\d\d$", shown, re.M), shown
    for row in ("run summary: cli", "held-out accuracy", "→ best", "reward_curve.png", "mlflow ui --backend-store-uri"):
        assert row in shown, (row, shown)
    assert "prefect server start" in shown
    kept = log.read_text()
    assert "Loading weights" in kept and "it/s" in kept  # the workers' progress bars went to the log
    run_id = json.loads((finished_run / "run_state.json").read_text())["mlflow_run_id"]
    tags = MlflowClient(f"sqlite:///{finished_run.parent.parent / 'mlflow.db'}").get_run(run_id).data.tags
    assert tags["machine.threads_per_worker"] == "1" and tags["machine.cpu"] in shown and "machine.gemm" in tags


def test_run_writes_the_run_directory(finished_run: Path) -> None:
    assert (finished_run / "final" / "model.safetensors").is_file()
    assert (finished_run / "reward_curve.png").stat().st_size > 1000
    assert (finished_run.parent.parent / "mlflow.db").is_file()


def test_eval_reports_greedy_pass_at_1(finished_run: Path) -> None:
    out = rlstages("eval", str(finished_run), cwd=finished_run.parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "eval/reward_mean" in out.stdout and "step 2" in out.stdout


def test_resume_of_a_finished_run_is_a_no_op_that_succeeds(finished_run: Path) -> None:
    before = (finished_run / "final" / "model.safetensors").read_bytes()
    out = rlstages("resume", str(finished_run), cwd=finished_run.parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "nothing to resume" in out.stdout and "finished" in out.stdout  # nothing started (no flow run)
    assert (finished_run / "final" / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize(
    ("args", "needle", "code"),
    [
        (("run", "configs/nope.yaml"), "no such config file", 2),
        (("run", "configs/tiny.yaml", "rollout.n=one"), "rollout.n: Input should be a valid integer", 2),
        (("resume", "not-a-run"), "not a run directory", 2),
        (("eval", "not-a-run"), "not a run directory", 2),
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
    out = rlstages(*args, cwd=tmp_path, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == code and len(lines) == 1 and needle in lines[0], out.stderr
