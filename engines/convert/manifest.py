"""Output directories: written into a temporary sibling and renamed into place, closed by a manifest.

A converted directory is complete exactly when its `manifest.json` exists; the manifest lists every file
with its size and checksum (XXH3-128 by default; crc32, sha256 or none when asked), so `verify_manifest` can
tell a damaged copy from a good one.
Non-goal: what the files contain.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlstages.engines.convert.safetensors_io import DEFAULT_CHECKSUM, checksum_enabled, file_checksum

MANIFEST = "manifest.json"
FORMAT = "rlstages-mcore/1"
HF_FILES_DIR = "hf"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
WEIGHT_INDEX = "model.safetensors.index.json"


@contextmanager
def atomic_directory(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes `out` only if the block succeeds (else it is removed)."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: already exists; choose another output directory or pass overwrite=True")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        _fsync_dir(tmp)
        if out.exists():
            trash = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(trash)
            tmp.rename(out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_hf_side_files(hf_dir: Path, dest: Path) -> list[Path]:
    """Copy config.json, tokenizer and other non-weight top-level files of an HF directory into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(Path(hf_dir).iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and path.name != WEIGHT_INDEX:
            shutil.copy2(path, dest / path.name)
            copied.append(dest / path.name)
    return copied


def write_manifest(
    directory: Path, info: Mapping[str, Any], checksums: Mapping[str, str], algorithm: str = DEFAULT_CHECKSUM
) -> Path:
    """Write `manifest.json` (last): `info` plus size and checksum of every other file under `directory`."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = path.relative_to(directory).as_posix()
        entry: dict[str, Any] = {"bytes": path.stat().st_size}
        if checksum_enabled(algorithm):
            entry[algorithm] = checksums.get(rel) or file_checksum(path, algorithm)
        files[rel] = entry
    manifest = {"format": FORMAT, **info, "checksum": algorithm, "files": files}
    target = directory / MANIFEST
    target.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return target


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a converted directory; an error if it is missing (an incomplete output)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; {directory} is not a complete conversion output")
    return json.loads(path.read_text())


def verify_manifest(directory: str | Path) -> dict[str, Any]:
    """Check every file's size and checksum against the manifest; returns the manifest."""
    manifest = read_manifest(directory)
    algorithm = manifest.get("checksum", "sha256")
    for rel, meta in manifest["files"].items():
        path = Path(directory) / rel
        if not path.is_file():
            raise ValueError(f"{path}: listed in the manifest but missing")
        if path.stat().st_size != meta["bytes"] or (
            checksum_enabled(algorithm) and file_checksum(path, algorithm) != meta[algorithm]
        ):
            raise ValueError(f"{path}: size or {algorithm} differs from the manifest (damaged or modified)")
    return manifest
