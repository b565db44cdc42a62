"""Small helpers every part of `engines/` shares, defined once: a free port, import by "module:Name" (the
one importer of such strings, with its one error type),
an atomic text write, a call begun in a background thread, the dtype names and a layer's autocast dtype (torch
imported only where a dtype is asked for).

Non-goal: anything that knows about models, batches or Ray.
"""

from __future__ import annotations

import contextvars
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")
R = TypeVar("R")


def start_in_thread(call: Callable[[], R], name: str) -> Future[R]:
    """`call()` begun in a daemon thread named `name` (a Ctrl-C does not wait for it), in a copy of the caller's
    context; its result, or what it raised, is the returned future's, for whoever waits on it."""
    future: Future[R] = Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(run,), name=name, daemon=True).start()
    return future


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name ("float32", "bfloat16", "float16"); torch is imported here, not at
    the module's import: the torch-free processes (the reward scorer's actor and pool) import this module."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_NAMES)}")
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a layer computes `x` in: autocast's for x's device where autocast is on, else x's own."""
    import torch

    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for a torch.distributed rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def atomic_write_text(path: Path, text: str) -> None:
    """Write text via a temp file, fsync and rename: readers see the old file or the new one, never half."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
