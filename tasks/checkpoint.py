"""Checkpoints that are either committed or invisible.

Commit order: every engine writes into `checkpoints/.step_N.tmp`, the driver state (step, data cursor,
KL controller, MLflow run id) follows, files are fsynced, the directory is renamed to `step_N`, and the
manifest (with SHA-256 of every file) is written last. A checkpoint without a valid manifest does not
exist for `latest_checkpoint`, so a crash at any point leaves the previous one loadable.

Two stages: `write_checkpoint` (the engines' state to disk: what must end before an engine changes again) and
`commit_checkpoint` (fsync, rename, checksums, manifest, pruning: it only reads the written files, so the flow
may run it beside the next step, `checkpoint.commit_in_background`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, NoReturn

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlstages.configs import RunConfig
from rlstages.engines.training.state_io import atomic_write_text
from rlstages.tasks.driver import tracking
from rlstages.tasks.driver.checkpoints import DRIVER_STATE, MANIFEST, checkpoint_dir, read_manifest, sha256_files
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.faults import maybe_fail
from rlstages.tasks.policies import root_cause
from rlstages.tasks.stage_workers import stage_workers


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_dir(run: RunHandle, step: int) -> Path:
    """Where step `step`'s checkpoint is written before its commit renames it."""
    return run.checkpoints / f".step_{step:06d}.tmp"


@task(name="checkpoint", cache_policy=NO_CACHE)
def write_checkpoint(cfg: RunConfig, run: RunHandle, step: int, driver_state: dict[str, Any]) -> dict[str, Any] | None:
    """Write every trainable engine's state and the driver state into the step's staging directory; returns the
    manifest's fields for `commit_checkpoint`, or None where this step's checkpoint is already committed."""
    maybe_fail(run, "checkpoint", step)
    if read_manifest(checkpoint_dir(run, step), verify=True) is not None:
        return None  # idempotent: a retried task finds its work done (and intact)
    tmp = staging_dir(run, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write(cfg, run, tmp, step, driver_state)
    except Exception as exc:
        _not_committed(tmp, step, exc)
    # the steps up to this one reach MLflow first, unless it is away: the manifest says how many wait in the
    # run's tracking journal (a resumed run sends them); in the flow's thread, where the steps are logged
    unsent = tracking.flush(driver_state.get("mlflow_run_id"))
    return {**driver_state, "tracking_unsent": unsent}


@task(name="commit_checkpoint", cache_policy=NO_CACHE)
def commit_checkpoint(cfg: RunConfig, run: RunHandle, step: int, fields: dict[str, Any]) -> str:
    """Commit step `step`'s written checkpoint (fsync, rename, SHA-256 manifest, pruning); returns the manifest
    path. It reads the written files only, so it may run while the next step uses the engines; a retry after the
    rename finishes the manifest from the renamed directory."""
    final, tmp = checkpoint_dir(run, step), staging_dir(run, step)
    if tmp.is_dir():
        try:
            _fsync_tree(tmp)  # where a full disk may first say so (delayed allocation)
        except Exception as exc:
            _not_committed(tmp, step, exc)
        shutil.rmtree(final, ignore_errors=True)  # an uncommitted or corrupt leftover of a crashed attempt
        os.replace(tmp, final)
    elif (final / MANIFEST).exists():  # committed by an earlier attempt
        if read_manifest(final, verify=True) is None:
            raise RuntimeError(f"checkpoint step {step}: {final / MANIFEST} does not verify; not committed again")
        return str(final / MANIFEST)
    elif not final.is_dir():
        raise FileNotFoundError(f"checkpoint step {step}: neither {tmp} nor {final} exists (was it written?)")
    maybe_fail(run, "checkpoint_commit", step)  # drills: a crash between the rename and the manifest
    written = [p for p in sorted(final.rglob("*")) if p.is_file()]
    files = {str(p.relative_to(final)): digest for p, digest in zip(written, sha256_files(written), strict=True)}
    manifest = {"step": step, "created": time.time(), "files": files, **fields}
    atomic_write_text(final / MANIFEST, json.dumps(manifest, indent=2))
    if fields.get("mlflow_run_id"):
        tracking.log_file(cfg, fields["mlflow_run_id"], final / MANIFEST, f"checkpoints/step_{step:06d}")
    prune(run, cfg.checkpoint.keep)
    return str(final / MANIFEST)


def _not_committed(tmp: Path, step: int, exc: Exception) -> NoReturn:
    """Drop the staging directory (the previous committed checkpoint stays the newest) and raise: a storage failure
    (a full disk inside a worker or at the fsync) as one line, anything else as it is."""
    shutil.rmtree(tmp, ignore_errors=True)
    code = _storage_errno(root_cause(exc))
    if code is not None:
        raise OSError(
            code, f"checkpoint step {step} not committed ({os.strerror(code)}); the previous one is intact"
        ) from exc
    raise exc


def _storage_errno(cause: BaseException) -> int | None:
    """The errno of a storage failure (OSError, or a writer's error that carries one in its text: safetensors)."""
    if isinstance(cause, OSError) and cause.errno:
        return cause.errno
    text = str(cause)
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):
        if os.strerror(code) in text or f"code: {code}," in text:
            return code
    return None


def _write(cfg: RunConfig, run: RunHandle, tmp: Path, step: int, driver_state: dict[str, Any]) -> None:
    """Every engine's state and the driver state into `tmp` (the commit fsyncs them)."""
    w = stage_workers(cfg, run, "checkpoint")
    w.actor.save(tmp / "actor")
    if w.workers.critic is not None:
        w.trainer("critic").save(tmp / "critic")
    atomic_write_text(tmp / DRIVER_STATE, json.dumps({**driver_state, "step": step}, indent=2))


def prune(run: RunHandle, keep: int) -> None:
    """Delete all but the newest `keep` committed checkpoints, and stale temporary directories."""
    committed = [p for p in sorted(run.checkpoints.glob("step_*")) if read_manifest(p) is not None]
    for path in committed[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for path in run.checkpoints.glob(".step_*.tmp"):
        shutil.rmtree(path, ignore_errors=True)


def restore_engines(cfg: RunConfig, run: RunHandle, path: Path) -> None:
    """Load a committed checkpoint into the trainable engines (not the rollout: sync does that)."""
    w = stage_workers(cfg, run, "checkpoint")
    w.actor.load(path / "actor")
    if w.workers.critic is not None:
        w.trainer("critic").load(path / "critic")
