"""Run lifecycle stages: prepare the run directory, start or resume MLflow and the workers, recover from a
lost worker, export the final policy, and close.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_link_artifact
from prefect.cache_policies import NO_CACHE

from rlstages.configs import RunConfig, config_hash, to_yaml
from rlstages.configs.loader import flatten
from rlstages.engines.models import ensure_model
from rlstages.engines.training.state_io import atomic_write_text
from rlstages.tasks import prefect_api
from rlstages.tasks.advantage import initial_kl_state
from rlstages.tasks.checkpoint import restore_engines
from rlstages.tasks.driver import tracking
from rlstages.tasks.driver.checkpoints import driver_state, latest_checkpoint, read_manifest
from rlstages.tasks.driver.context import RUN_STATE, RunHandle
from rlstages.tasks.driver.data.loading import cursor, data_record
from rlstages.tasks.driver.preflight import check_import_allowed
from rlstages.tasks.driver.run_dir import clear_dir, read_state, resolve_run_dir, starts_over
from rlstages.tasks.driver.run_dir import run_dir as run_dir  # re-exported: flows import it from here
from rlstages.tasks.driver.run_lock import acquire, release
from rlstages.tasks.driver.workers import (
    build_workers,
    converted_dir,
    converted_layout,
    forget_workers,
    model_dir,
    rebuild_workers,
)
from rlstages.tasks.policies import stage_logger
from rlstages.tasks.rollout import sync_weights
from rlstages.tasks.stage_workers import stage_workers


@dataclass(frozen=True)
class StartPoint:
    """Where a (possibly resumed) run starts: the last completed step and the driver state at that point."""

    step: int
    kl_state: dict[str, float]
    checkpoint: str | None


def _state(run: RunHandle) -> dict[str, Any]:
    return read_state(run.path)


def write_state(run: RunHandle, **updates: Any) -> None:
    """Update the run-state file (MLflow run id, status) atomically."""
    atomic_write_text(run.path / RUN_STATE, json.dumps({**_state(run), **updates}, indent=2))


@task(name="prepare_run", cache_policy=NO_CACHE)
def prepare_run(cfg: RunConfig) -> RunHandle:
    """Create or reopen the run directory (a different config for an existing run, or one another process is
    running, is refused); build the model."""
    from prefect.runtime import flow_run

    check_import_allowed(cfg)  # a deployment's run imports only what the deployment allows
    path = resolve_run_dir(cfg, str(flow_run.id) if flow_run.id else None)
    acquire(path)  # one run per directory (a no-op when the CLI took it); released by close_run
    if starts_over(cfg, path):  # nothing committed there: the failed start's leftovers must not mix with ours
        stage_logger().warning(f"{path} held a run that committed nothing; starting over there")
        clear_dir(path)
    run = RunHandle(name=path.name, run_dir=str(path.resolve()))
    path.mkdir(parents=True, exist_ok=True)
    write_state(run, config_hash=config_hash(cfg))  # first: a config.yaml always has its hash beside it
    atomic_write_text(path / "config.yaml", to_yaml(cfg))
    tiny = cfg.model.tiny.model_dump() if cfg.model.tiny else None
    ensure_model(cfg.model.path, cfg.model.provider, tiny, cfg.model.revision)
    return run


@task(name="start_tracking", cache_policy=NO_CACHE)
def start_tracking(cfg: RunConfig, run: RunHandle) -> str:
    """Create the MLflow run, or reattach to the one this run directory recorded."""
    from prefect.runtime import flow_run

    flow_run_id = str(flow_run.id) if flow_run.id else None
    recorded = _state(run).get("mlflow_run_id")
    if recorded is not None:
        check_same_config(cfg, recorded)
    run_id = tracking.start_or_resume(cfg, run.name, recorded, flow_run_id, run.path)
    if recorded is None:
        tracking.log_dataset(cfg, run_id, data_record(cfg))
    write_state(run, mlflow_run_id=run_id, status="RUNNING")
    return run_id


def link_mlflow_run(cfg: RunConfig, run: RunHandle, mlflow_run_id: str) -> None:
    """A Prefect link artifact to the MLflow run; called by the flow, so the flow run's Artifacts tab shows it."""
    create_link_artifact(
        key=re.sub(r"[^a-z0-9-]", "-", f"mlflow-{run.name.lower()}")[:60],
        link=tracking.run_link(cfg, mlflow_run_id),
        link_text=f"MLflow run {mlflow_run_id}",
        description="the MLflow record of this training run",
    )


_PLACE_KEYS = ("trainer.output_dir", "trainer.run_name", "checkpoint.resume", "trainer.checkpoint_on_signal")


def check_same_config(cfg: RunConfig, mlflow_run_id: str) -> None:
    """Never reopen an MLflow run under another config: every param it recorded (the flattened config) must
    match this config's value (keys it does not have, e.g. a newer release's defaulted fields, are not compared)."""
    recorded = tracking.client(cfg).get_run(mlflow_run_id).data.params
    ours = flatten(cfg.model_dump(mode="json"))
    for key, value in sorted(recorded.items()):
        if key in ours and key not in _PLACE_KEYS and ours[key][:6000] != value:
            raise ValueError(
                f"MLflow run {mlflow_run_id} recorded {key}={value!r}, this config has {ours[key][:80]!r}; "
                "it is not reopened under another config (choose another trainer.run_name)"
            )


@task(name="start_workers", cache_policy=NO_CACHE)
def start_workers(cfg: RunConfig, run: RunHandle) -> StartPoint:
    """Build the worker groups; restore the last committed checkpoint if there is one; sync the rollout."""
    forget_workers(run, kill=True)
    build_workers(cfg, run)
    start = _restore(cfg, run)
    sync_weights.fn(cfg, run, start.step)
    return start


def _restore(cfg: RunConfig, run: RunHandle) -> StartPoint:
    # fresh: only this flow run's earlier attempt wrote here
    found = latest_checkpoint(run, verify=True, on_corrupt=cfg.checkpoint.on_corrupt)
    if found is None:
        return StartPoint(step=0, kl_state=initial_kl_state(cfg), checkpoint=None)
    step, path = found
    restore_engines(cfg, run, path)
    state = driver_state(path)
    return StartPoint(step=step, kl_state=state.get("kl_state", initial_kl_state(cfg)), checkpoint=str(path))


@task(name="recover_workers", cache_policy=NO_CACHE, retries=1)
def recover_workers(cfg: RunConfig, run: RunHandle) -> StartPoint:
    """After a worker died: rebuild every group (placement reserved again on the cluster as it is now),
    reload the last committed checkpoint (or the initial weights), sync the rollout engines; the flow replays
    from the returned step.
    """
    rebuild_workers(cfg, run)
    start = _restore(cfg, run)
    sync_weights.fn(cfg, run, start.step)
    return start


def convert_for_training(cfg: RunConfig, run: RunHandle) -> str | None:
    """HF -> Megatron-Core conversion before a Megatron actor starts (a cached task: re-runs do no work)."""
    out, layout = converted_dir(cfg), converted_layout(cfg)
    if out is None or layout is None:
        return None
    from rlstages.tasks.convert import convert_checkpoint

    tp, pp, vpp = (layout[1].pop(k) for k in ("tp", "pp", "vpp"))
    # overwrite: our own cache directory, where an older conversion of ours is replaced
    return str(convert_checkpoint(model_dir(cfg), str(out), tp, pp, vpp, overwrite=True, **layout[1]))


def driver_snapshot(cfg: RunConfig, step: int, kl_state: dict[str, float], mlflow_run_id: str) -> dict[str, Any]:
    """The driver state saved with a checkpoint."""
    return {
        "data_cursor": cursor(cfg.data, step + 1),
        "kl_state": kl_state,
        "mlflow_run_id": mlflow_run_id,
        "config_hash": config_hash(cfg),
    }


@task(name="export_policy", cache_policy=NO_CACHE)
def export_policy(cfg: RunConfig, run: RunHandle, mlflow_run_id: str) -> str:
    """Write the final policy as an HF directory and log it to MLflow from that path (no load in the driver);
    with a registered model name, alias `final` marks it and `best` the checkpoint with the best held-out reward.
    """
    out = _save_hf(cfg, run, "final")
    if cfg.tracking.log_model:  # logging a model needs the server: what was journaled goes first
        tracking.wait_for_backlog(mlflow_run_id, cfg.tracking.outage_wait_s)
        version = tracking.log_policy(cfg, mlflow_run_id, out, step=cfg.trainer.total_steps)
        if version is not None:
            tracking.set_alias(cfg, "final", version)
            _register_best(cfg, run, mlflow_run_id, version)
    return str(out)


def _save_hf(cfg: RunConfig, run: RunHandle, name: str) -> Path:
    """The actor's current weights as an HF directory `run_dir/name` (written beside, then renamed)."""
    out, tmp = run.path / name, run.path / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    # every rank takes part (gathering sharded weights is a collective); the engines write from one rank
    stage_workers(cfg, run, "checkpoint").actor.save_pretrained(tmp, Path(model_dir(cfg)))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def best_checkpoint(cfg: RunConfig, run: RunHandle, mlflow_run_id: str) -> tuple[int, Path] | None:
    """The kept checkpoint with the highest held-out reward (the later one on a tie), or None."""
    rewards = dict(tracking.metric_history(cfg, mlflow_run_id, "eval/reward_mean"))
    kept = []
    for path in sorted(run.checkpoints.glob("step_*")) if run.checkpoints.is_dir() else []:
        manifest = read_manifest(path)
        if manifest is not None and int(manifest["step"]) in rewards:
            kept.append((int(manifest["step"]), path))
    return max(kept, key=lambda sp: (rewards[sp[0]], sp[0]), default=None)


def _register_best(cfg: RunConfig, run: RunHandle, mlflow_run_id: str, final_version: str) -> None:
    best = best_checkpoint(cfg, run, mlflow_run_id)
    if best is None:
        return
    step, path = best
    version = final_version
    if step != cfg.trainer.total_steps:  # an earlier checkpoint was better: export and register it too
        restore_engines(cfg, run, path)
        version = tracking.log_policy(cfg, mlflow_run_id, _save_hf(cfg, run, "best"), "best_policy", step) or version
    tracking.set_alias(cfg, "best", version)
    stage_logger().info(f"registry alias best -> version {version} (checkpoint of step {step})")


def close_run(
    cfg: RunConfig,
    run: RunHandle,
    mlflow_run_id: str | None,
    status: str,
    error: str | None = None,
    stage: str | None = None,
) -> None:
    """End the MLflow run with `status` (FAILED carries the stage and error as tags) and free the workers; wait
    for an MLflow or Prefect server that is away (`tracking.outage_wait_s`; a few seconds for an interrupt)."""
    wait = cfg.tracking.outage_wait_s if status != "KILLED" else min(cfg.tracking.outage_wait_s, 5.0)
    if mlflow_run_id is not None:
        if error is not None:
            tracking.set_tags(
                cfg, mlflow_run_id, {"rlstages.failed_stage": stage or "unknown", "rlstages.error": error[:2000]}
            )
        unsent = tracking.end(cfg, mlflow_run_id, status, wait)
        if unsent:
            stage_logger().warning(
                f"MLflow did not answer within {wait:g} s (tracking.outage_wait_s): {unsent} tracking calls "
                f"stay in {run.path / 'tracking'}; a re-run of this run sends them first"
            )
    write_state(run, status=status)
    forget_workers(run, kill=True)
    release(run.path)
    prefect_api.wait_until_answering(wait)  # the flow run's final state gets through
