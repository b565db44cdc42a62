"""The one bucketizer every weight transport shares, and the object store's encoding of a bucket.

`group_buckets` cuts a stream of named tensors into lists of about `bucket_bytes` (sized in the dtype they travel
in; a tensor larger than that goes alone), so no transport ever holds a second full copy of the model: the object
store (`bucketize`: each tensor cast to the rollout dtype and encoded as numpy, bf16 as an int16 view, so Ray moves
it zero-copy), the collective broadcast (`collective.wire.send_weights`), the shared-memory files and the CUDA IPC
push of a colocated engine (`sync.shm_files`, `sync.cuda_ipc`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

from rlstages.engines.types import Bucket
from rlstages.engines.utils import torch_dtype

V = TypeVar("V")
DEFAULT_BUCKET_BYTES = 512 * 2**20  # a colocated engine's push into its own worker processes
_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """The bytes of `tensor` once in `dtype` (default: its own)."""
    return tensor.numel() * (dtype.itemsize if dtype is not None else tensor.element_size())


def group_buckets(
    named: Iterable[tuple[str, V]], bucket_bytes: int, nbytes: Callable[[V], int]
) -> Iterator[list[tuple[str, V]]]:
    """Group a stream of named items into lists whose `nbytes` add up to at most `bucket_bytes` (an item larger
    than that goes alone), in the stream's order; items are pulled one at a time."""
    bucket: list[tuple[str, V]] = []
    size = 0
    for name, item in named:
        n = nbytes(item)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, item))
        size += n
    if bucket:
        yield bucket


def tensor_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`group_buckets` of tensors sized as they travel: in `dtype` (the cast a transport makes), else their own."""
    return group_buckets(named, bucket_bytes, lambda t: tensor_bytes(t, dtype))


def encode_tensor(tensor: torch.Tensor, dtype: str) -> tuple[str, np.ndarray]:
    """A tensor cast to `dtype` as a numpy array (half types as an int16 view), copied off a GPU first."""
    t = tensor.detach().to(device="cpu", dtype=torch_dtype(dtype)).contiguous()
    view = _VIEW.get(t.dtype)
    return dtype, (t.view(view) if view is not None else t).numpy()


def decode_tensor(dtype: str, array: np.ndarray) -> torch.Tensor:
    """Inverse of `encode_tensor` (no copy; the result may be read-only)."""
    t, kind = torch.from_numpy(np.asarray(array)), torch_dtype(dtype)
    return t.view(kind) if kind in _VIEW else t


def bucketize(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: str) -> Iterator[Bucket]:
    """Named tensors as encoded object-store buckets of about `bucket_bytes` (`group_buckets`), each tensor encoded
    as it is pulled; storage shared by two names (tied embeddings) is sent under every name."""
    encoded = ((name, encode_tensor(tensor, dtype)) for name, tensor in named)
    for group in group_buckets(encoded, bucket_bytes, lambda pair: int(pair[1].nbytes)):
        yield [(name, kind, array) for name, (kind, array) in group]


def decode_bucket(bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a bucket."""
    for name, kind, array in bucket:
        yield name, decode_tensor(kind, array)


def apply_bucket(engine: Any, bucket: Bucket) -> int:
    """Runs inside a rollout actor (`__ray_call__`): hand a decoded bucket to the engine."""
    engine.update_weights(decode_bucket(bucket))
    return len(bucket)
