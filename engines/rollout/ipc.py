"""Hand weight tensors to an inference engine's worker process through shared memory.

vLLM's `collective_rpc` carries control messages only: tensors nested in its arguments arrive as plain lists.
So weights travel the way verl sends CUDA-IPC buckets, with a host-memory twin: the front end writes a bucket
of named tensors as one safetensors file under /dev/shm, the worker reads it by path and loads it, the front
end deletes it. One bucket is in flight at a time, so the extra memory is bounded by `bucket_bytes`.

Non-goal: multi-node transport (the worker must see the same /dev/shm).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DEFAULT_BUCKET_BYTES = 512 * 2**20


def shm_dir() -> Path:
    """Where buckets go: /dev/shm when writable (RAM-backed), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of named tensors into lists of about `bucket_bytes` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


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
