"""What a run shows, checked without running one: the per-step log line, the flow-run and task-run names, the
configured concurrency, the MLflow tracking URI's precedence and system tags, `--version` and shell completion.
Seconds."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlstages.configs import load_config
from rlstages.flows.progress import step_line
from rlstages.flows.stages import MAX_PARALLEL_STAGES, Stages
from rlstages.flows.train import rl_post_train
from rlstages.tasks.driver import tracking

ROOT = Path(__file__).resolve().parents[2]


def tiny(*overrides: str):
    return load_config(ROOT / "configs" / "tiny.yaml", list(overrides))


def test_step_line_has_step_reward_kl_throughput_time_and_stage_timings() -> None:
    metrics = {
        "reward/mean": 0.25,
        "actor/ppo_kl": 0.0123,
        "throughput/tokens_per_s": 1234.5,
        "timing/step_s": 3.5,
        "timing/generate_s": 2.0,
        "timing/update_actor_s": 1.5,
    }
    line = step_line(3, 300, metrics)
    assert line.startswith("step 3/300 reward 0.2500 kl 0.0123 tokens/s 1,234 time 3.50s")
    assert line.endswith("(generate 2.00s, update_actor 1.50s)")  # slowest first, the step total not repeated
    assert "kl nan" in step_line(1, 1, {"reward/mean": 1.0})  # no KL term: said, not invented
    assert math.isnan(float(re.search(r"kl (\S+)", step_line(1, 1, {})).group(1)))


def test_task_runs_are_named_by_stage_and_step_and_concurrency_is_configured() -> None:
    stages = Stages.configured(tiny("prefect.max_concurrent_stages=2"))
    assert stages.generate.task_run_name == "generate[step={step}]"
    assert stages.advantages.task_run_name == "advantages[step={step}]"
    assert stages.export_policy.task_run_name == "export_policy" and stages.prepare_run.task_run_name == "prepare_run"
    assert stages.max_parallel == 2
    assert Stages.configured(tiny("prefect.max_concurrent_stages=16")).max_parallel == MAX_PARALLEL_STAGES
    # the widest fan-out still has its threads while a checkpoint's commit holds one of the flow's pool
    assert rl_post_train.task_runner._max_workers == MAX_PARALLEL_STAGES + 1  # noqa: SLF001 - no public getter
    policy = tiny("prefect.stages.generate.retries=5").prefect.policy("generate")
    assert Stages.configured(tiny("prefect.stages.generate.retries=5")).generate.retries == policy.retries == 5


def test_flow_run_name_is_the_run_name() -> None:
    from rlstages.flows.progress import run_name_of

    cfg = tiny("trainer.run_name=my-run")
    assert run_name_of(cfg) == "my-run"
    assert run_name_of(cfg.model_dump(mode="json")) == "my-run"  # a deployment passes the config as JSON
    assert run_name_of({"not": "a config"}) == "rl-post-train"


def test_tracking_uri_config_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking.tracking_uri(tiny()) == "http://127.0.0.1:5999"  # tiny.yaml sets none
    assert tracking.tracking_uri(tiny("tracking.tracking_uri=sqlite:///x.db")) == "sqlite:///x.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking.tracking_uri(tiny()) == tracking.DEFAULT_URI


def test_system_tags_are_mlflows_own() -> None:
    tags = tracking.run_tags(tiny(), "flow-1")
    assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.user"]
    assert tags["mlflow.source.name"] == os.path.basename(sys.argv[0])
    assert tags.get("mlflow.source.git.commit", "unknown") == tags["rlstages.git_commit"]
    assert tags["rlstages.prefect_flow_run_id"] == "flow-1"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlstages.flows.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_version_and_shell_completion() -> None:
    from importlib.metadata import version

    done = _cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"rlstages {version('rlstages')}"
    # the script `rlstages --show-completion` prints for the detected shell, asked for bash by name (shell
    # detection needs a parent shell, which a test runner started without one does not have)
    script = Path(sys.executable).parent / "rlstages"
    env = {**os.environ, "_RLSTAGES_COMPLETE": "source_bash"}
    completion = subprocess.run([str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert completion.returncode == 0, completion.stderr[-2000:]
    assert "complete -o default -F _rlstages_completion rlstages" in completion.stdout
