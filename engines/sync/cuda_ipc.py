"""Weights shared between processes on one node without a copy through a socket: CUDA IPC on a GPU (verl's and
OpenRLHF's colocated push), a shared-memory segment on the CPU (the same protocol, testable without a GPU).

The sender (`FlatPusher`) keeps ONE flat byte buffer on its device across pushes. A push casts each tensor into
it at a fixed, 256-byte aligned offset (the layout of `payload.unpack`: name, dtype, shape, offset as JSON) and
sends a message of plain values (str, int, bytes: fit for vLLM's msgpack `collective_rpc`, no pickle): the
buffer's id, the push's version, the meta, and the buffer's handle the first time only. `share` makes that handle
from torch's own `reduce_tensor` (CUDA) or the shared-memory file name (CPU), with the GPU named by UUID:
CUDA_VISIBLE_DEVICES differs between the trainer's and the engine's processes, so the receiver maps the UUID to
its own device index (OpenRLHF's `get_physical_gpu_id`). The receiver (`receive`) maps the buffer once and caches
it by id, takes views of its tensors, loads them, and synchronises its device before answering, so the next push
may overwrite the buffer. A push is then the cast-copy into the buffer, one device sync, one message and the
receiver's copy: no fresh bucket, handle and mapping per bucket (issue 41: those made it 6.5-7x a device copy).

Which push a colocated engine's worker processes get (this one on a GPU, `shm_files.ShmFilePush` on the CPU) is
chosen once, by the engine's device, in `sync.registry.ENGINE_PUSH`.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from rlstages.engines.runtime.payload import layout, pack_into, unpack

T = TypeVar("T")
Handle = dict[str, Any]  # plain values only: str, int, bytes, bool
Meta = bytes  # the bucket's JSON meta (`payload.layout`)


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
    # what reduce_storage does under file_system sharing
    manager, name, size = via_shm_manager(storage._share_filename_cpu_)
    storage._shared_incref()  # the receiver's rebuild drops this reference
    return {
        "kind": "cpu",
        "manager": manager,
        "handle": name,
        "storage_bytes": int(size),
        "offset": payload.storage_offset(),
        "numel": payload.numel(),
    }


SHM_MANAGER_TRIES = 3


def via_shm_manager(call: Callable[[], T]) -> T:
    """`call` (a CPU storage shared or mapped through torch's shared-memory manager), tried again where the
    manager's acknowledgement missed libshm's short wait, which a loaded machine can make it do ("Shared memory
    manager connection has timed out", seen once in a CI run on 2 busy cores); other errors are raised at once."""
    for attempt in range(1, SHM_MANAGER_TRIES + 1):
        try:
            return call()
        except RuntimeError as exc:
            if "timed out" not in str(exc) or attempt == SHM_MANAGER_TRIES:
                raise
            time.sleep(0.2 * attempt)
    raise AssertionError("unreachable")


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

    storage = via_shm_manager(
        lambda: rebuild_storage_filename(
            torch.UntypedStorage, handle["manager"], handle["handle"], handle["storage_bytes"]
        )
    )
    out = torch.empty(0, dtype=torch.uint8)
    out.set_(storage, handle["offset"], (handle["numel"],))  # type: ignore[call-overload]  # untyped storage is accepted
    return out


ALIGN = 256  # bytes: every tensor of a push starts on this boundary (vectorised copies, any dtype's alignment)
Message = dict[str, Any]  # one push message: plain values only (str, int, bytes, list, a `share` handle or None)

_MAPPED: dict[str, torch.Tensor] = {}  # receiver side: the sender's persistent buffers mapped here, by buffer id
_VIEWS: dict[tuple[str, bytes], list[tuple[str, torch.Tensor]]] = {}  # (buffer id, meta) -> its named views


def receive(message: Message, load: Callable[[list[tuple[str, torch.Tensor]]], Any]) -> int:
    """Runs in the receiving process: unmap the buffers the sender dropped, map a buffer the first time its handle
    comes (then cached by id: later pushes send only its id and the offsets), hand the named views into it to
    `load`, and wait for the device before answering (the sender overwrites the buffer at its next push).
    The views of a (buffer, meta) pair are made once: a push with the last push's layout reuses them, so the
    per-push cost is the load, not hundreds of slices. Returns the number of tensors loaded.

    Raises:
        RuntimeError: a message names a buffer whose handle this process never received.
    """
    for old in message.get("drop", ()):
        _MAPPED.pop(old, None)
        for key in [k for k in _VIEWS if k[0] == old]:
            del _VIEWS[key]
    meta = message.get("meta")
    if not meta:
        return 0
    buffer_id = message["buffer"]
    if message.get("handle") is not None:
        _MAPPED[buffer_id] = rebuild(message["handle"])
        for key in [k for k in _VIEWS if k[0] == buffer_id]:
            del _VIEWS[key]
    if buffer_id not in _MAPPED:
        raise RuntimeError(
            f"CUDA IPC: weight buffer {buffer_id} was never shared with this process (pid-local cache); "
            "the sender must send its handle with the first message that uses it"
        )
    payload = _MAPPED[buffer_id]
    named = _VIEWS.get((buffer_id, meta))
    if named is None:
        named = _VIEWS[(buffer_id, meta)] = unpack_bucket(meta, payload)
    load(list(named))
    if payload.is_cuda:
        torch.cuda.synchronize(payload.device)
    return len(named)


def mapped_buffers() -> list[str]:
    """The ids of the sender buffers this process has mapped (what `receive` caches)."""
    return list(_MAPPED)


class FlatPusher:
    """The sender's side of the weight push: one flat byte buffer on `device` kept across pushes, shared once.

    A push casts every tensor of its buckets into the buffer at a fixed offset (256-byte aligned) and sends one
    message per buffer it filled: the buffer's id, its `share` handle the first time only, the push's version and
    the JSON meta of names, shapes and offsets. The receiver (`receive`) maps the buffer once and caches it, so a
    push is the cast-copy into the buffer, one device sync, one message and the receiver's own copy, not a fresh
    allocation, IPC handle and mapping per bucket. The destination views into the buffer are made once and
    reused (a push with the last one's layout is one `_foreach_copy_` per bucket), because the slices and views
    per tensor, not the bytes, were what a push cost (~13.5 ms at 135M and 1.5B alike, issue 41).

    The first push does not know the total size: it fills buffers the size of its buckets (one message each,
    never overwriting within a push: the receiver may keep views until the push ends, e.g. the parts of a fused
    layer). From the second push on, one buffer of the whole push's size holds every bucket (one message).
    `release` gives the memory back."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self.version = 0
        self._buffers: list[tuple[str, torch.Tensor]] = []  # (id, flat uint8 tensor), normally one
        self._shared: set[str] = set()  # ids whose handle the receiver has
        self._dropped: list[str] = []  # ids to unmap in the receiver with the next message
        self._want = 0  # bytes the last push needed: the next push's single buffer
        self._views: dict[str, tuple[str, int, torch.Size, torch.Tensor]] = {}  # name -> (buffer, offset, shape, view)

    @property
    def capacity(self) -> int:
        """Bytes held in buffers on the device (kept between pushes)."""
        return sum(b.numel() for _, b in self._buffers)

    def _allocate(self, nbytes: int) -> tuple[str, torch.Tensor]:
        buffer_id = f"{os.getpid()}-{uuid.uuid4().hex}"
        return buffer_id, torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _drop(self, send: Callable[[Message], int]) -> None:
        """Every buffer out: the receiver unmaps them, then their blocks return to this process's allocator."""
        self._dropped.extend(i for i, _ in self._buffers)
        self._buffers = []
        self._views.clear()
        if self._dropped:
            send({"drop": self._dropped})
            self._dropped = []
        self._shared.clear()
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()

    def _message(self, index: int, entries: list[list[Any]]) -> Message:
        buffer_id, buffer = self._buffers[index]
        handle = None if buffer_id in self._shared else share(buffer)
        self._shared.add(buffer_id)
        message: Message = {
            "buffer": buffer_id,
            "handle": handle,
            "version": self.version,
            "meta": json.dumps(entries).encode(),
        }
        if self._dropped:
            message["drop"], self._dropped = self._dropped, []
        return message

    def push(
        self, buckets: Iterable[list[tuple[str, torch.Tensor]]], send: Callable[[Message], int]
    ) -> dict[str, float]:
        """Cast the buckets' tensors into the persistent buffer and `send` one message per buffer filled (a call
        that returns once the receiver has loaded them, with the tensor count). Returns the push's metrics."""
        start = time.perf_counter()
        self.version += 1
        if self._want and (len(self._buffers) != 1 or self._buffers[0][1].numel() < self._want):
            self._drop(send)  # last push spread over several buffers: one of its whole size from now on
            self._buffers = [self._allocate(self._want)]
        index, cursor, total = 0, 0, 0
        entries: list[list[Any]] = []
        buckets_seen = tensors = messages = 0
        views = self._views
        dtype_name = str(self.dtype).removeprefix("torch.")

        def flush() -> None:
            nonlocal tensors, messages
            if not entries:
                return
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the receiver reads on another stream, in another process
            tensors += int(send(self._message(index, entries)))
            messages += 1
            entries.clear()

        for bucket in buckets:
            buckets_seen += 1
            sizes = [_aligned(t.numel() * self.dtype.itemsize) for _, t in bucket]
            need = sum(sizes)
            total += need
            if not self._buffers or cursor + need > self._buffers[index][1].numel():
                if self._buffers and cursor:  # this buffer is full: send it, go on in the next one
                    flush()
                    index, cursor = index + 1, 0
                if index < len(self._buffers) and self._buffers[index][1].numel() < need:
                    old_id = self._buffers[index][0]
                    self._dropped.append(old_id)
                    self._views = views = {k: v for k, v in views.items() if v[0] != old_id}
                    self._buffers[index] = self._allocate(need)
                elif index >= len(self._buffers):
                    self._buffers.append(self._allocate(need))
            buffer_id, buffer = self._buffers[index]
            targets, sources = [], []
            for (name, tensor), size in zip(bucket, sizes, strict=True):
                cached = views.get(name)
                if cached is None or cached[:3] != (buffer_id, cursor, tensor.shape):
                    nbytes = tensor.numel() * self.dtype.itemsize
                    view = buffer[cursor : cursor + nbytes].view(self.dtype).view(tensor.shape)
                    cached = views[name] = (buffer_id, cursor, tensor.shape, view)
                targets.append(cached[3])
                sources.append(tensor.detach())
                entries.append([name, dtype_name, list(tensor.shape), cursor])
                cursor += size
            torch._foreach_copy_(targets, sources)  # one call per bucket: the cast is the copy, views made once
            del targets, sources
        flush()
        if self._dropped and self.device.type == "cuda":  # a buffer outgrown in this push: unmapped at the next
            torch.cuda.ipc_collect()
        self._want = total
        return {
            "sync/buckets": float(buckets_seen),
            "sync/messages": float(messages),
            "sync/tensors": float(tensors),
            "sync/bytes": float(total),
            "timing/sync_push_s": time.perf_counter() - start,
        }

    def release(self, send: Callable[[Message], int] | None = None) -> None:
        """Free the buffers (the receiver told to unmap them first where `send` is given)."""
        if send is not None:
            self._drop(send)
        else:
            self._buffers, self._dropped = [], []
            self._shared.clear()
            self._views.clear()
        self._want = 0
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
