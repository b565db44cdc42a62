"""The run directory: where a config's run lives (`trainer.output_dir / run_name`), its run-state file, and which
directory a config may start or continue -- never one holding another config's committed work.

Light on purpose (no Prefect, MLflow or torch): the pre-flight and `config show` use it before anything starts.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from rlstages.configs import RunConfig, config_hash
from rlstages.configs.trainer import RUN_NAME
from rlstages.tasks.driver.context import RUN_STATE


def run_dir(cfg: RunConfig) -> Path:
    """`trainer.output_dir / run_name` (run_name defaults to `run-<config hash>`)."""
    name = cfg.trainer.run_name or f"run-{config_hash(cfg)}"
    if not RUN_NAME.fullmatch(name):  # the schema checks it too; a constructed config may skip the schema
        raise ValueError(f"trainer.run_name {name!r}: use letters, digits, '_' and '-' only")
    return cfg.trainer.output_dir / name


def read_state(path: Path) -> dict[str, Any]:
    """The run-state file of a run directory ({} when there is none); one-line error when it is damaged."""
    state = path / RUN_STATE
    if not state.is_file():
        return {}
    try:
        data = json.loads(state.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{state}: damaged run-state file ({exc}); move it away to start over") from None
    if not isinstance(data, dict):
        raise ValueError(f"{state}: damaged run-state file (expected a JSON object)")
    return data


def resolve_run_dir(cfg: RunConfig, flow_run_id: str | None = None) -> Path:
    """The run directory this config starts or continues; refuses (one line) what would overwrite a run. A
    directory that committed nothing (a run that failed or stopped before its first checkpoint) blocks no one:
    the run starts over in it (`starts_over`)."""
    path = run_dir(cfg)
    if cfg.checkpoint.resume == "fresh":  # one directory per flow run: a retry of that flow run resumes it
        suffix = flow_run_id[:8] if flow_run_id else time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        path = path.with_name(f"{path.name}-{suffix}")
    if (path / "config.yaml").is_file() and holds_progress(path):
        if cfg.checkpoint.resume == "never":
            raise FileExistsError(
                f"{path} already holds a run and checkpoint.resume=never; choose another trainer.run_name"
            )
        old = read_state(path).get("config_hash")
        if old != config_hash(cfg):  # a run dir with no recorded hash is not provably this config's
            raise ValueError(
                f"{path} holds a run of another config (hash {old}, this one {config_hash(cfg)}); resume it with "
                f"`rlstages resume {path}` or choose another trainer.run_name"
            )
    return path


def finished(path: Path, cfg: RunConfig) -> bool:
    """True when `path` holds this config's run, ended FINISHED with its final policy exported: resuming it has
    nothing left to do (its saved config fixes the number of steps)."""
    state = read_state(path)
    done = state.get("status") == "FINISHED" and state.get("config_hash") == config_hash(cfg)
    return done and (path / "final").is_dir()


def holds_progress(path: Path) -> bool:
    """True when a run directory holds what a run continues from or must not lose: a committed checkpoint (a
    manifest, even a damaged one) or an exported policy."""
    return (path / "final").exists() or any((path / "checkpoints").glob("step_*/manifest.json"))


def starts_over(cfg: RunConfig, path: Path) -> bool:
    """True when `path` holds a run of ours that committed nothing and this config does not continue it (another
    config, or checkpoint.resume=never): its leftovers (state, step batches, fault markers) are cleared first."""
    if not (path / "config.yaml").is_file() or holds_progress(path):
        return False
    try:
        same = read_state(path).get("config_hash") == config_hash(cfg)
    except ValueError:  # a damaged run-state file of a run that committed nothing
        same = False
    return cfg.checkpoint.resume == "never" or not same


def clear_dir(path: Path) -> None:
    """Remove what a directory holds, keeping the directory itself (it may be a link or a mount point)."""
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
