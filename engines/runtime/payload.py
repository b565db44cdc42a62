"""The payload of a weight-sync bucket: its tensors cast to one dtype and laid end to end in one byte tensor,
with JSON meta (name, dtype, shape, byte offset) beside it. This is also the layout of SGLang's
`FlattenedTensorBucket`, so the same payload serves `sync.collective` and `sync.collective.flat`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import torch


def layout(bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A bucket's meta bytes (name, dtype, shape, offset) once cast to `dtype`, and its payload size."""
    meta, offset = [], 0
    for name, tensor in bucket:
        meta.append([name, str(dtype).removeprefix("torch."), list(tensor.shape), offset])
        offset += tensor.numel() * dtype.itemsize
    return torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8), offset


def pack_into(bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype, payload: torch.Tensor) -> None:
    """Cast each tensor of the bucket into its slice of `payload` (one pass: the cast is the copy)."""
    offset = 0
    for _, tensor in bucket:
        n = tensor.numel() * dtype.itemsize
        payload[offset : offset + n].view(dtype).view(tensor.shape).copy_(tensor.detach())
        offset += n


def unpack(meta: torch.Tensor, payload: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors of a payload: views of it, nothing copied."""
    for name, dtype, shape, offset in json.loads(bytes(meta.cpu().numpy()).decode()):
        kind = getattr(torch, dtype)
        size = torch.Size(shape).numel() * kind.itemsize
        yield name, payload[offset : offset + size].view(kind).reshape(shape)
