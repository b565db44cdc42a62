"""Weight buckets shared between processes on one node without a copy through a socket: CUDA IPC on a GPU (verl's
and OpenRLHF's colocated push), a shared-memory segment on the CPU (the same protocol, testable without a GPU).

A bucket of named tensors is cast into ONE flat byte tensor (`payload.layout` / `payload.pack_into`: the layout
collective sync and SGLang's `FlattenedTensorBucket` use) with its JSON meta (name, dtype, shape, offset) beside
it. `share` turns the payload into a handle of plain values (str, int, bytes): one per bucket, never one per
parameter, and fit for any control channel (vLLM's msgpack `collective_rpc` needs no pickle for it). The
handle is torch's own `reduce_tensor` of the payload (CUDA) or its shared-memory file name (CPU), with the GPU
named by UUID: CUDA_VISIBLE_DEVICES differs between the trainer's and the engine's processes, so the receiver
maps the UUID to its own device index (OpenRLHF's `get_physical_gpu_id`). The receiver `rebuild`s the payload,
takes views of its tensors (`unpack_bucket`), loads them, and synchronises its device before answering; the
sender drops its payload, and once the round is over returns the blocks the receivers released
(`torch.cuda.ipc_collect`, `empty_cache`). torch's IPC reference counts keep a block alive while a receiver
still holds a view of it, so a fused layer whose parts span two buckets is safe.

`weight_transport` is the one place that chooses how weights reach an engine's worker process on this node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from rlstages.engines.runtime.payload import layout, pack_into, unpack

Handle = dict[str, Any]  # plain values only: str, int, bytes, bool
Meta = bytes  # the bucket's JSON meta (`payload.layout`)
Transport = Literal["cuda_ipc", "shm_file"]


def weight_transport(engine_device: torch.device) -> Transport:
    """How a colocated engine's worker process gets weights: CUDA IPC buckets when it computes on a GPU, the
    CPU twin (safetensors files under /dev/shm, `rollout.ipc`) otherwise."""
    return "cuda_ipc" if engine_device.type == "cuda" else "shm_file"


def pack_bucket(
    bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> tuple[Meta, torch.Tensor]:
    """The bucket cast to `dtype` into one fresh flat uint8 tensor on `device`, and its meta."""
    meta, nbytes = layout(bucket, dtype)
    payload = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pack_into(bucket, dtype, payload)
    return bytes(meta.numpy()), payload


def unpack_bucket(meta: Meta, payload: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a received payload: views of it, in the sender's order."""
    return list(unpack(torch.frombuffer(bytearray(meta), dtype=torch.uint8), payload))


def gpu_uuid(index: int) -> str:
    """The UUID of CUDA device `index` as this process numbers it (the same GPU has one UUID everywhere)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: str, visible: list[str]) -> int:
    """This process's index of the GPU `uuid`, given the UUIDs of its visible devices in order.

    Raises:
        RuntimeError: the GPU is not visible here (its CUDA_VISIBLE_DEVICES leaves it out).
    """
    if uuid not in visible:
        raise RuntimeError(
            f"CUDA IPC: the sender's GPU {uuid} is not among this process's visible GPUs {visible}; "
            "colocated processes must see the same GPU (check CUDA_VISIBLE_DEVICES)"
        )
    return visible.index(uuid)


def share(payload: torch.Tensor) -> Handle:
    """A handle of plain values by which another process on this node maps `payload` (kept alive by the caller
    until that process has answered)."""
    if payload.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(payload)
        (_, _, _, offset, _, _, device, handle, size, storage_offset, _, ref_handle, ref_offset, event, sync) = args
        return {
            "kind": "cuda",
            "gpu": gpu_uuid(int(device)),
            "numel": payload.numel(),
            "offset": int(offset),
            "handle": handle,
            "storage_bytes": int(size),
            "storage_offset": int(storage_offset),
            "ref_handle": ref_handle,
            "ref_offset": int(ref_offset),
            "event": event,
            "event_sync": bool(sync),
        }
    storage = payload.untyped_storage()
    manager, name, size = storage._share_filename_cpu_()  # what reduce_storage does under file_system sharing
    storage._shared_incref()  # the receiver's rebuild drops this reference
    return {
        "kind": "cpu",
        "manager": manager,
        "handle": name,
        "storage_bytes": int(size),
        "offset": payload.storage_offset(),
        "numel": payload.numel(),
    }


def rebuild(handle: Handle) -> torch.Tensor:
    """The payload a `share` handle names, mapped into this process (on the GPU: the same GPU by UUID)."""
    if handle["kind"] == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        visible = [gpu_uuid(i) for i in range(torch.cuda.device_count())]
        device = local_index(handle["gpu"], visible)
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size([handle["numel"]]),
            (1,),
            handle["offset"],
            torch.TypedStorage,
            torch.uint8,
            device,
            handle["handle"],
            handle["storage_bytes"],
            handle["storage_offset"],
            False,
            handle["ref_handle"],
            handle["ref_offset"],
            handle["event"],
            handle["event_sync"],
        )
    from torch.multiprocessing.reductions import rebuild_storage_filename

    storage = rebuild_storage_filename(
        torch.UntypedStorage, handle["manager"], handle["handle"], handle["storage_bytes"]
    )
    out = torch.empty(0, dtype=torch.uint8)
    out.set_(storage, handle["offset"], (handle["numel"],))  # type: ignore[call-overload]  # untyped storage is accepted
    return out


def receive_bucket(handle: Handle, meta: Meta, load: Callable[[list[tuple[str, torch.Tensor]]], Any]) -> int:
    """Runs in the receiving process: map the payload, hand its named views to `load`, and wait for the device
    before answering (the sender may free the bucket once this returns). Returns the number of tensors."""
    payload = rebuild(handle)
    named = unpack_bucket(meta, payload)
    load(named)
    count = len(named)
    del named, payload
    if handle["kind"] == "cuda":
        torch.cuda.synchronize()
    return count


def push_buckets(
    buckets: Iterable[list[tuple[str, torch.Tensor]]],
    dtype: torch.dtype,
    device: torch.device,
    send: Callable[[Handle, Meta], int],
) -> dict[str, float]:
    """Runs in the sender: pack each bucket on `device`, share it, and `send` its handle (a call that returns
    once the receiver has loaded it, with the tensor count); one bucket is alive at a time. Then the blocks the
    receivers released go back (`ipc_collect`, `empty_cache`)."""
    start = time.perf_counter()
    buckets_sent = tensors = 0
    nbytes = 0
    for bucket in buckets:
        meta, payload = pack_bucket(bucket, dtype, device)
        if payload.is_cuda:
            torch.cuda.synchronize(payload.device)  # the receiver reads on another stream, in another process
        tensors += int(send(share(payload), meta))
        buckets_sent += 1
        nbytes += payload.numel()
        del payload
    if device.type == "cuda":
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
    return {
        "sync/buckets": float(buckets_sent),
        "sync/tensors": float(tensors),
        "sync/bytes": float(nbytes),
        "timing/sync_push_s": time.perf_counter() - start,
    }
