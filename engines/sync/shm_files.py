"""Hand weight tensors to an inference engine's worker process through shared memory.

vLLM's `collective_rpc` carries control messages only: tensors nested in its arguments arrive as plain lists.
So weights travel the way verl sends CUDA-IPC buckets, with a host-memory twin: the front end writes a bucket
of named tensors as one safetensors file under /dev/shm, the worker reads it by path and loads it, the front
end deletes it (`ShmFilePush`). One bucket is in flight at a time, so the extra memory is bounded by `bucket_bytes`
(the buckets: `sync.buckets.tensor_buckets`). The same directory holds a same-node sync group's shared file
(`collective.shared_region`).

Non-goal: multi-node transport (the worker must see the same /dev/shm).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def shm_dir() -> Path:
    """Where buckets go: /dev/shm when writable (RAM-backed), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def write_bucket(bucket: list[tuple[str, torch.Tensor]], directory: Path | None = None) -> Path:
    """Write named CPU tensors to a fresh safetensors file and return its path (the caller deletes it)."""
    directory = directory or shm_dir()
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in bucket:
        t = tensor.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        # safetensors refuses tensors that share storage (tied weights, views): give those their own copy.
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    path = directory / f"rlstages-weights-{os.getpid()}-{uuid.uuid4().hex}.safetensors"
    save_file(tensors, str(path))
    return path


def read_bucket(path: str | Path) -> list[tuple[str, torch.Tensor]]:
    """Read a bucket written by `write_bucket`, in name order."""
    return sorted(load_file(str(path)).items())


class ShmFilePush:
    """The CPU push into a colocated engine's worker processes: each bucket cast to `dtype` (floating tensors),
    written as one file, `send` (a call that returns once the workers have loaded it, with one worker's tensor
    count) given its path, then deleted. The same interface as `cuda_ipc.FlatPusher`; nothing is kept between
    pushes."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device

    def push(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], send: Callable[[str], int]) -> dict[str, float]:
        """Write, send and delete each bucket in turn; returns the push's metrics."""
        start = time.perf_counter()
        count = tensors = 0
        for bucket in buckets:
            cast = [(name, t.detach().to(self.dtype) if t.is_floating_point() else t.detach()) for name, t in bucket]
            path = write_bucket(cast)
            try:
                tensors += int(send(str(path)))
            finally:
                path.unlink(missing_ok=True)
            count += 1
        return {
            "sync/buckets": float(count),
            "sync/messages": float(count),
            "sync/tensors": float(tensors),
            "timing/sync_push_s": time.perf_counter() - start,
        }

    def release(self, send: Callable[[str], int] | None = None) -> None:
        """Nothing is held between pushes."""
