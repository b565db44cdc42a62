"""Trainer -> rollout weight sync, streamed in buckets by HF name.

The trainer turns its `named_weights()` into buckets of at most `bucket_bytes`, cast to the rollout dtype
and encoded as numpy (bf16 travels as an int16 view), so Ray moves them zero-copy through the object
store; each rollout rank decodes a bucket and calls its engine's `update_weights`. At most two buckets
are in flight, so no process ever holds a second full copy of the model.

For split placement the default is the collective transport of `collective_sync` (a broadcast group of the
trainer's source rank and the rollout workers); this module's path remains for `cluster.weight_sync=object_store`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from rlstages.engines.utils import DTYPES

Bucket = list[tuple[str, str, np.ndarray]]
_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def encode_tensor(tensor: torch.Tensor, dtype: str) -> tuple[str, np.ndarray]:
    """A tensor cast to `dtype` as a numpy array (half types as an int16 view), copied off a GPU first."""
    t = tensor.detach().to(device="cpu", dtype=DTYPES[dtype]).contiguous()
    view = _VIEW.get(t.dtype)
    return dtype, (t.view(view) if view is not None else t).numpy()


def decode_tensor(dtype: str, array: np.ndarray) -> torch.Tensor:
    """Inverse of `encode_tensor` (no copy; the result may be read-only)."""
    t = torch.from_numpy(np.asarray(array))
    return t.view(DTYPES[dtype]) if DTYPES[dtype] in _VIEW else t


def bucketize(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: str) -> Iterator[Bucket]:
    """Group named tensors into encoded buckets of about `bucket_bytes`; storage shared by two names
    (tied embeddings) is sent under every name."""
    bucket: Bucket = []
    size = 0
    for name, tensor in named:
        kind, array = encode_tensor(tensor, dtype)
        bucket.append((name, kind, array))
        size += array.nbytes
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def decode_bucket(bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a bucket."""
    for name, kind, array in bucket:
        yield name, decode_tensor(kind, array)


def apply_bucket(engine: Any, bucket: Bucket) -> int:
    """Runs inside a rollout actor (`__ray_call__`): hand a decoded bucket to the engine."""
    engine.update_weights(decode_bucket(bucket))
    return len(bucket)


def sync_weights_ray(
    trainers: list[Any], source: int, rollouts: list[Any], bucket_bytes: int, dtype: str, timeout: float
) -> dict[str, float]:
    """Stream buckets from trainer rank `source` to every rollout actor.

    Every trainer rank runs its `weight_buckets` generator at once, because gathering sharded weights
    (ZeRO-3, TP) is a collective; only the source rank's buckets are applied, the others are dropped.
    """
    import ray

    start = time.perf_counter()
    streams = [t.weight_buckets.options(num_returns="streaming").remote(bucket_bytes, dtype) for t in trainers]
    inflight: list[Any] = []
    buckets = tensors = 0
    for ref in streams[source]:
        if inflight:
            tensors += sum(ray.get(inflight, timeout=timeout)) // max(1, len(rollouts))
        inflight = [h.__ray_call__.remote(apply_bucket, ref) for h in rollouts]
        buckets += 1
    if inflight:
        tensors += sum(ray.get(inflight, timeout=timeout)) // max(1, len(rollouts))
    for rank, stream in enumerate(streams):
        if rank != source:
            for _ in stream:  # let the other ranks finish their part of the collectives
                pass
    return {
        "sync/buckets": float(buckets),
        "sync/tensors": float(tensors),
        "timing/sync_weights_s": time.perf_counter() - start,
    }


def sync_weights_local(trainer: Any, rollouts: list[Any], bucket_bytes: int, dtype: str) -> dict[str, float]:
    """The same through plain calls (engines in-process, for tests)."""
    start = time.perf_counter()
    buckets = tensors = 0
    for bucket in trainer.weight_buckets(bucket_bytes, dtype):
        for rollout in rollouts:
            apply_bucket(rollout, bucket)
        buckets += 1
        tensors += len(bucket)
    return {
        "sync/buckets": float(buckets),
        "sync/tensors": float(tensors),
        "timing/sync_weights_s": time.perf_counter() - start,
    }
