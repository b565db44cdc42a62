"""The committed checkpoints of a run, read side: manifests (SHA-256 of every file), the newest committed one,
verification. A checkpoint without a valid manifest does not exist for `latest_checkpoint`. The commit itself is
the `checkpoint` stage (`rlstages.tasks.checkpoint`); this module is Prefect-free so that the pre-flight and the
CLI read checkpoints without it.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlstages.tasks.driver.context import RunHandle

MANIFEST = "manifest.json"
DRIVER_STATE = "driver_state.json"


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def sha256_files(paths: list[Path]) -> list[str]:
    """The hex SHA-256 of each file, hashed in parallel threads (hashlib releases the GIL on large blocks): a
    checkpoint's weights and optimizer states hash side by side, not one after the other."""
    if len(paths) < 2:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(sha256_file, paths))


def checkpoint_dir(run: RunHandle, step: int) -> Path:
    """The committed location of step `step`."""
    return run.checkpoints / f"step_{step:06d}"


class CheckpointError(ValueError):
    """A committed checkpoint that cannot be used; the message names the directory and why."""


def read_manifest(path: Path, verify: bool = False) -> dict[str, Any] | None:
    """The manifest of a checkpoint directory, or None when it is not committed (or, with verify, corrupt)."""
    try:
        return checked_manifest(path, verify)
    except CheckpointError:
        return None


def checked_manifest(path: Path, verify: bool = True) -> dict[str, Any] | None:
    """The manifest of `path`; None when no manifest was committed; CheckpointError naming the file when the
    manifest is unreadable or (with verify) a listed file is missing, truncated or altered."""
    target = path / MANIFEST
    if not target.is_file():
        return None
    try:
        manifest = json.loads(target.read_text())
        step = int(manifest["step"])
        files = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({type(exc).__name__}: {exc})") from None
    if verify:
        for rel in files:
            if not (path / rel).is_file():
                raise CheckpointError(f"checkpoint {path}: {rel} is listed in {MANIFEST} but missing")
        found = sha256_files([path / rel for rel in files])
        for (rel, digest), actual in zip(files.items(), found, strict=True):
            if actual != digest:
                raise CheckpointError(
                    f"checkpoint {path}: {rel} does not match its sha256 in {MANIFEST} (truncated or altered)"
                )
    return {**manifest, "step": step}


def latest_checkpoint(run: RunHandle, verify: bool = False, on_corrupt: str = "error") -> tuple[int, Path] | None:
    """The newest committed checkpoint as (step, dir), or None. A directory without a manifest is an interrupted
    commit (reported, skipped); a corrupt one (with verify) raises CheckpointError, or with
    on_corrupt="fallback" is reported and the next older one is tried."""
    if not run.checkpoints.is_dir():
        return None
    for path in sorted(run.checkpoints.glob("step_*"), reverse=True):
        try:
            manifest = checked_manifest(path, verify)
        except CheckpointError as exc:
            if on_corrupt != "fallback":
                raise CheckpointError(f"{exc}; set checkpoint.on_corrupt=fallback to use an older one") from None
            _warn(f"{exc}; falling back to an older checkpoint (checkpoint.on_corrupt=fallback)")
            continue
        if manifest is None:
            _warn(f"checkpoint {path}: no {MANIFEST} (an interrupted commit); it is ignored")
            continue
        return int(manifest["step"]), path
    return None


def verify_checkpoint(path: Path) -> int:
    """The step of a committed, intact checkpoint directory (what `eval --checkpoint` accepts); else an error."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: no such directory")
    manifest = checked_manifest(path, verify=True)
    if manifest is None:
        raise CheckpointError(f"checkpoint {path}: no {MANIFEST}; not a committed checkpoint")
    return int(manifest["step"])


def _warn(message: str) -> None:
    import logging
    import sys

    logging.getLogger("rlstages.checkpoint").warning(message)
    sys.stderr.write(f"warning: {message}\n")
    sys.stderr.flush()


def driver_state(path: Path) -> dict[str, Any]:
    """The driver state saved with a checkpoint."""
    return json.loads((path / DRIVER_STATE).read_text())
