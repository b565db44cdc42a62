"""Run lifecycle stages: prepare the run directory, start or resume MLflow and the workers, recover from a
lost worker, export the final policy, and close.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_link_artifact
from prefect.cache_policies import NO_CACHE

from rlstages.configs import RunConfig, config_hash, to_yaml
from rlstages.configs.training import MegatronTrainingConfig
from rlstages.engines.models import ensure_model
from rlstages.engines.training.state_io import atomic_write_text
from rlstages.tasks import tracking
from rlstages.tasks.advantage import initial_kl_state
from rlstages.tasks.checkpoint import driver_state, latest_checkpoint, restore_engines
from rlstages.tasks.context import RunHandle
from rlstages.tasks.data import cursor
from rlstages.tasks.policies import guard_workers
from rlstages.tasks.rollout import sync_weights
from rlstages.tasks.workers import build_workers, converted_dir, forget_workers, get_workers, rebuild_workers

RUN_STATE = "run_state.json"


@dataclass(frozen=True)
class StartPoint:
    """Where a (possibly resumed) run starts: the last completed step and the driver state at that point."""

    step: int
    kl_state: dict[str, float]
    checkpoint: str | None


def run_dir(cfg: RunConfig) -> Path:
    """`trainer.output_dir / run_name` (run_name defaults to `run-<config hash>`)."""
    name = cfg.trainer.run_name or f"run-{config_hash(cfg)}"
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ValueError(f"trainer.run_name {name!r}: use letters, digits, '.', '_' and '-' only")
    return cfg.trainer.output_dir / name


def _state(run: RunHandle) -> dict[str, Any]:
    path = run.path / RUN_STATE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_state(run: RunHandle, **updates: Any) -> None:
    """Update the run-state file (MLflow run id, status) atomically."""
    atomic_write_text(run.path / RUN_STATE, json.dumps({**_state(run), **updates}, indent=2))


def resolve_run_dir(cfg: RunConfig, flow_run_id: str | None = None) -> Path:
    """The run directory this config starts or continues; refuses (one line) what would overwrite a run."""
    path = run_dir(cfg)
    if cfg.checkpoint.resume == "fresh":  # one directory per flow run: a retry of that flow run resumes it
        suffix = flow_run_id[:8] if flow_run_id else time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        path = path.with_name(f"{path.name}-{suffix}")
    if (path / "config.yaml").is_file():
        if cfg.checkpoint.resume == "never":
            raise FileExistsError(
                f"{path} already holds a run and checkpoint.resume=never; choose another trainer.run_name"
            )
        state = path / RUN_STATE
        old = json.loads(state.read_text()).get("config_hash") if state.is_file() else None
        if old is not None and old != config_hash(cfg):
            raise ValueError(
                f"{path} holds a run of another config (hash {old}, this one {config_hash(cfg)}); resume it with "
                f"`rlstages resume {path}` or choose another trainer.run_name"
            )
    return path


@task(name="prepare_run", cache_policy=NO_CACHE)
def prepare_run(cfg: RunConfig) -> RunHandle:
    """Create or reopen the run directory (a different config for an existing run is refused); build the model."""
    from prefect.runtime import flow_run

    path = resolve_run_dir(cfg, str(flow_run.id) if flow_run.id else None)
    run = RunHandle(name=path.name, run_dir=str(path.resolve()))
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path / "config.yaml", to_yaml(cfg))
    write_state(run, config_hash=config_hash(cfg))
    ensure_model(cfg.model.path, cfg.model.provider, cfg.model.tiny.model_dump() if cfg.model.tiny else None)
    return run


@task(name="start_tracking", cache_policy=NO_CACHE)
def start_tracking(cfg: RunConfig, run: RunHandle) -> str:
    """Create the MLflow run, or reattach to the one this run directory recorded; link it from Prefect."""
    from prefect.runtime import flow_run

    flow_run_id = str(flow_run.id) if flow_run.id else None
    run_id = tracking.start_or_resume(cfg, run.name, _state(run).get("mlflow_run_id"), flow_run_id)
    write_state(run, mlflow_run_id=run_id, status="RUNNING")
    create_link_artifact(
        key=f"mlflow-{run.name.lower().replace('_', '-')}"[:60],
        link=tracking.run_link(cfg, run_id),
        link_text=f"MLflow run {run_id}",
        description="the MLflow record of this training run",
    )
    return run_id


@task(name="start_workers", cache_policy=NO_CACHE)
def start_workers(cfg: RunConfig, run: RunHandle) -> StartPoint:
    """Build the worker groups; restore the last committed checkpoint if there is one; sync the rollout."""
    forget_workers(run, kill=True)
    build_workers(cfg, run)
    start = _restore(cfg, run)
    sync_weights.fn(cfg, run, start.step)
    return start


def _restore(cfg: RunConfig, run: RunHandle) -> StartPoint:
    found = latest_checkpoint(run, verify=True)  # fresh: only this flow run's earlier attempt wrote here
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
    out = converted_dir(cfg)
    if out is None:
        return None
    from rlstages.tasks.convert import convert_checkpoint

    a = cfg.actor
    assert isinstance(a, MegatronTrainingConfig)
    return str(
        convert_checkpoint(
            str(cfg.model.path.resolve()),
            str(out),
            a.tensor_model_parallel_size,
            a.pipeline_model_parallel_size,
            a.virtual_pipeline_model_parallel_size,
        )
    )


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
    """Write the final policy as an HF directory and log it to MLflow as a transformers model."""
    out = run.path / "final"
    tmp = run.path / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    workers = get_workers(cfg, run)
    timeout = cfg.prefect.policy("checkpoint").timeout_seconds
    # every rank takes part (gathering sharded weights is a collective); the engines write from one rank
    guard_workers(lambda: workers.actor.all(timeout).save_pretrained(str(tmp), str(cfg.model.path.resolve())))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    if cfg.tracking.log_model:
        tracking.log_policy(cfg, mlflow_run_id, out)
    return str(out)


def close_run(
    cfg: RunConfig,
    run: RunHandle,
    mlflow_run_id: str | None,
    status: str,
    error: str | None = None,
    stage: str | None = None,
) -> None:
    """End the MLflow run with `status` (FAILED carries the stage and error as tags) and free the workers."""
    if mlflow_run_id is not None:
        if error is not None:
            tracking.set_tags(
                cfg, mlflow_run_id, {"rlstages.failed_stage": stage or "unknown", "rlstages.error": error[:2000]}
            )
        tracking.end(cfg, mlflow_run_id, status)
    write_state(run, status=status)
    forget_workers(run, kill=True)
