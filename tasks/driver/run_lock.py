"""One run per run directory at a time: the lock `<output_dir>/.<run name>.lock` beside the run directory.

The lock is the kernel's (`flock` on that file), so it ends with the process that holds it: a crashed or killed
run leaves a file that blocks no one, and a re-run takes the lock over. The file names its holder (host, pid,
start time, command) for the one-line refusal of a second run. It lives beside the run directory, not in it: a
refused run touches nothing of the running one, and a run that starts over in its directory (`clear_dir`)
keeps its lock. Held once per process (the CLI takes it before the flow, the flow takes it again: a no-op), and
released when the run closes or the process ends.

Also here: `file_lock`, the blocking lock that serialises the creation of a tracking store by processes that
start together.

Light on purpose (no Prefect, MLflow or torch): the CLI takes the lock before anything starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

_HELD: dict[str, int] = {}  # lock path -> the open file this process holds its lock on


class RunInUse(FileExistsError):
    """Another process runs under this run directory (its holder named in the message)."""


def lock_path(run_dir: Path) -> Path:
    """The lock file of a run directory: `.<name>.lock` beside it."""
    return run_dir.with_name(f".{run_dir.name}.lock")


def _holder(fd: int) -> dict[str, object]:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 65536).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def acquire(run_dir: Path) -> bool:
    """Hold `run_dir`'s lock for this process (True when this call took it, False when the process held it);
    RunInUse, naming the holder's host and pid, when another process holds it. Creates nothing in `run_dir`."""
    lock = lock_path(run_dir)
    key = os.path.abspath(lock)
    if key in _HELD:
        return False
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = _holder(fd)
        os.close(fd)
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(str(who.get("started", 0)))))
        raise RunInUse(
            f"trainer.run_name: {run_dir} is in use by another run (host {who.get('host', '?')}, pid "
            f"{who.get('pid', '?')}, since {since}; lock {lock}); wait for it to end, stop it, or choose another "
            "trainer.run_name"
        ) from None
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "command": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    _HELD[key] = fd
    return True


def release(run_dir: Path) -> None:
    """Give up this process's lock of `run_dir` (a no-op when it holds none); the file stays, blocking no one."""
    fd = _HELD.pop(os.path.abspath(lock_path(run_dir)), None)
    if fd is not None:
        os.close(fd)  # closing the file drops its flock


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for the block, waiting for another holder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
