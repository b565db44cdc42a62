"""Fault drills on the real training flow (tiny random model, real Prefect without a server, a real MLflow SQLite
store; the engines in the driver, `cluster.mode=in_process`, as the drills are about checkpoints and losses; worker
deaths under Ray are drilled in test_train_flow.py): the disk fills up during a checkpoint, a step's loss is NaN,
and the flow process is SIGKILLed between a checkpoint's rename and its manifest. Each time the previous checkpoint
stays intact and is the one a resume uses, so the resumed run ends bitwise equal to an uninterrupted one. Needs root
for the tmpfs drill (mount). CPU only, several minutes: `pytest tests/flows/test_fault_drills.py`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
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
)
from flow_support import tiny_cfg as _tiny_cfg
from safetensors.torch import load_file

from rlstages.configs import RunConfig, load_config
from rlstages.flows.train import rl_post_train
from rlstages.tasks.driver.checkpoints import MANIFEST, latest_checkpoint
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.update import NonFiniteStep


@pytest.fixture
def reference(reference_run: Reference) -> tuple[Path, RunConfig]:
    """The session's uninterrupted 2-step run (tests/flows/conftest.py) the drills are compared with: on Ray, it
    ends bit for bit where a run with the engines in the driver ends (tests/flows/test_train_flow.py)."""
    return reference_run.tmp, reference_run.cfg


@pytest.fixture
def faults(monkeypatch):
    def set_faults(spec: str) -> None:
        monkeypatch.setenv("RLSTAGES_FAULTS", spec)

    return set_faults


def tiny_cfg(tmp: Path, model_dir: Path, name: str, *extra: str) -> RunConfig:
    """tiny.yaml with the engines in the driver (`cluster.mode=in_process`): checkpoints and NaNs are the point."""
    return _tiny_cfg(tmp, model_dir, name, IN_DRIVER, *extra)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_disk_full_during_a_checkpoint_keeps_the_previous_one_and_resume_uses_it(
    reference, tiny_model_dir: Path, tmp_path: Path
) -> None:
    _, ref_cfg = reference
    one = _dir_bytes(run_dir(ref_cfg) / "checkpoints" / "step_000001")
    cfg = tiny_cfg(tmp_path, tiny_model_dir, "diskfull")
    checkpoints = cfg.trainer.output_dir / "diskfull" / "checkpoints"
    checkpoints.mkdir(parents=True)
    size_kib = (one * 3 // 2) // 1024 + 1  # room for one checkpoint, not for a second beside it
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(checkpoints)], check=True)
    try:
        with pytest.raises(OSError, match=r"checkpoint step 2 not committed \(No space left on device\)"):
            rl_post_train(cfg)
        run = RunHandle("diskfull", str(checkpoints.parent))
        found = latest_checkpoint(run, verify=True)
        assert found is not None and found[0] == 1  # intact (checksums verified) and still the newest
        assert not list(checkpoints.glob(".step_*.tmp")) and not (checkpoints / "step_000002").exists()
        _, failed = mlflow_run(cfg)
        assert failed.info.status == "FAILED" and failed.data.tags["rlstages.failed_stage"] == "checkpoint"
        subprocess.run(["mount", "-o", "remount,size=64m", str(checkpoints)], check=True)  # space is back
        rl_post_train(cfg)  # resumes from step 1 into the same MLflow run
        _, finished = mlflow_run(cfg)
        assert finished.info.status == "FINISHED" and finished.info.run_id == failed.info.run_id
        assert reward_steps(cfg) == [1, 2]
        assert same(final_weights(ref_cfg), final_weights(cfg))
    finally:
        subprocess.run(["umount", str(checkpoints)], check=False)


def test_nan_loss_stops_the_run_before_the_weights_are_synced_or_saved(
    reference, tiny_model_dir: Path, faults, tmp_path: Path
) -> None:
    _, ref_cfg = reference
    cfg = tiny_cfg(tmp_path, tiny_model_dir, "nanstop")
    faults("update_actor@2:nan")
    with pytest.raises(NonFiniteStep, match="update_actor at step 2: non-finite actor/"):
        rl_post_train(cfg)
    _, run = mlflow_run(cfg)
    assert run.info.status == "FAILED" and run.data.tags["rlstages.failed_stage"] == "update_actor"
    assert "non-finite" in run.data.tags["rlstages.error"]
    found = latest_checkpoint(RunHandle("nanstop", str(cfg.trainer.output_dir / "nanstop")), verify=True)
    assert found is not None and found[0] == 1
    ref_step1 = run_dir(ref_cfg) / "checkpoints" / "step_000001" / "actor"
    ours = load_file(str(found[1] / "actor" / "model.safetensors"))
    assert same(load_file(str(ref_step1 / "model.safetensors")), ours)
    rl_post_train(cfg)  # the fault fired once: a resume from step 1 finishes as if nothing happened
    assert same(final_weights(ref_cfg), final_weights(cfg))


def test_nan_loss_skipped_leaves_the_weights_unchanged(reference, tiny_model_dir: Path, faults, tmp_path: Path) -> None:
    _, ref_cfg = reference
    cfg = tiny_cfg(tmp_path, tiny_model_dir, "nanskip", "trainer.on_nonfinite=skip")
    faults("update_actor@2:nan")
    rl_post_train(cfg)
    step1 = cfg.trainer.output_dir / "nanskip" / "checkpoints" / "step_000001" / "actor" / "model.safetensors"
    before = load_file(str(step1)) if step1.is_file() else None
    after = final_weights(cfg)
    ref_step1 = run_dir(ref_cfg) / "checkpoints" / "step_000001" / "actor"
    assert same(load_file(str(ref_step1 / "model.safetensors")), after)  # step 2 was not applied
    assert before is None or same(before, after)
    c, run = mlflow_run(cfg)
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in c.get_metric_history(run.info.run_id, "train/rejected_steps")] == [(2, 1.0)]
    assert not same(final_weights(ref_cfg), after)  # the reference did learn at step 2


def test_sigkill_during_a_checkpoint_commit_then_resume(reference, tiny_model_dir: Path, tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL

    _, ref_cfg = reference
    api = {"PREFECT_API_URL": str(PREFECT_API_URL.value())}  # the session's Prefect API: no server of their own
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    (tmp_path / "drill.yaml").write_text(yaml.safe_dump(config))
    cfg = load_config(tmp_path / "drill.yaml", overrides(tmp_path, tiny_model_dir, "killed", IN_DRIVER))
    killed = cli(tmp_path, "run", "drill.yaml", *overrides(tmp_path, tiny_model_dir, "killed", IN_DRIVER),
                  env={**api, "RLSTAGES_FAULTS": "checkpoint_commit@2:sigkill"})  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_dir = cfg.trainer.output_dir / "killed"
    half = run_dir / "checkpoints" / "step_000002"
    assert half.is_dir() and not (half / MANIFEST).exists()  # renamed, never committed
    assert json.loads((run_dir / "run_state.json").read_text())["status"] == "RUNNING"
    resumed = cli(tmp_path, "resume", str(run_dir), env={**api, "RLSTAGES_FAULTS": ""})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_000002: no manifest.json (an interrupted commit); it is ignored" in resumed.stderr
    found = latest_checkpoint(RunHandle("killed", str(run_dir)), verify=True)
    assert found is not None and found[0] == 2 and (found[1] / MANIFEST).is_file()
    _, run = mlflow_run(cfg)
    assert run.info.status == "FINISHED" and reward_steps(cfg) == [1, 2]
    assert same(final_weights(ref_cfg), final_weights(cfg))
