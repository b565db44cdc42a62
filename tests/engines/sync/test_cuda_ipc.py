"""The CUDA IPC push protocol (`sync.cuda_ipc`) on the CPU: a bucket packed into one flat payload and read
back bit-exact; pushes into a second process through one persistent buffer whose handle (plain values that
survive msgpack, the encoding of vLLM's `collective_rpc`; torch's shared-memory twin of a CUDA IPC handle) is
sent once, every tensor of every push read there bit-exact, in the sender's order; the GPU-by-UUID remap; and
split placement's refusal of two sync ranks on one GPU. The CUDA path itself: tests/gpu/test_gpu_weight_sync.py.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import msgpack
import pytest
import torch

from rlstages.engines.sync import cuda_ipc, registry
from rlstages.engines.sync.collective.membership import distinct_gpus, same_nccl_cumem


def _bucket() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(11, 6, generator=g)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(13, generator=g)[::2]),  # not contiguous
        ("model.norm.weight", torch.randn(1, 3, 1, generator=g)),
    ]


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_pack_and_unpack_are_bit_exact(dtype: torch.dtype) -> None:
    bucket = _bucket()
    meta, payload = cuda_ipc.pack_bucket(bucket, dtype, torch.device("cpu"))
    got = cuda_ipc.unpack_bucket(meta, payload)
    assert [n for n, _ in got] == [n for n, _ in bucket]
    assert payload.dtype == torch.uint8 and payload.numel() == sum(t.numel() for _, t in bucket) * dtype.itemsize
    for (_, want), (_, have) in zip(bucket, got, strict=True):
        assert have.dtype == dtype and have.shape == want.shape
        assert _bytes(have) == _bytes(want.to(dtype))
    assert got[0][1].untyped_storage().data_ptr() == payload.untyped_storage().data_ptr()  # views, no copy


def _receiver(conn: Any) -> None:
    """The second process: `receive` each message, send back the bytes of every tensor and the buffers mapped."""
    while True:
        message = conn.recv_bytes()
        if not message:
            return
        seen: list[tuple[str, bytes, str, list[int]]] = []

        def load(named: list[tuple[str, torch.Tensor]], seen: list = seen) -> None:
            seen.extend((n, _bytes(t), str(t.dtype), list(t.shape)) for n, t in named)

        count = cuda_ipc.receive(msgpack.unpackb(message), load)
        conn.send((count, seen, cuda_ipc.mapped_buffers()))


def test_pushes_reuse_one_buffer_shared_once_and_arrive_bit_exact() -> None:
    """Three pushes into a second process through msgpack (vLLM's RPC encoding): the first fills a buffer per
    bucket; from the second on, one buffer of the push's size, its handle sent once, then only its id, version and
    offsets; the receiver maps it once. Every push arrives bit-exact in the sender's order, the changed weights
    of each push included (a stale mapping would show the old bytes)."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(there,), daemon=True)
    child.start()
    there.close()  # the child holds the only other end: its death reads as EOF here, not a wait forever
    bucket = _bucket() + [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(8, 4)) for i in range(3)]
    messages: list[dict[str, Any]] = []
    received: list[tuple[str, bytes, str, list[int]]] = []
    mapped: list[list[str]] = []

    def send(message: dict[str, Any]) -> int:
        messages.append(message)
        here.send_bytes(msgpack.packb(message))  # plain values only: vLLM's RPC channel carries them
        assert here.poll(120), f"the receiver process gave no answer in 120 s (exit code {child.exitcode})"
        count, seen, buffers = here.recv()
        received.extend(seen)
        mapped.append(buffers)
        return count

    pusher = cuda_ipc.FlatPusher(torch.bfloat16, torch.device("cpu"))
    pushes: list[list[tuple[str, torch.Tensor]]] = []
    metrics = []
    try:
        for version in range(3):
            weights = [(n, t + version) for n, t in bucket]  # new weights every push
            pushes.append(weights)
            messages.clear(), received.clear()
            metrics.append(pusher.push([weights[:2], weights[2:4], weights[4:]], send))
            assert [n for n, *_ in received] == [n for n, _ in weights], version  # the sender's order
            for (name, data, dtype, shape), (_, want) in zip(received, weights, strict=True):
                assert data == _bytes(want.to(torch.bfloat16)), (version, name)
                assert dtype == "torch.bfloat16" and shape == list(want.shape)
            loads = [m for m in messages if m.get("meta")]
            assert all(m["version"] == version + 1 for m in loads)
            if version == 0:  # the size is not known yet: a buffer per bucket, each shared once
                assert len(loads) == 3 and all(m["handle"]["kind"] == "cpu" for m in loads)
                first = {m["buffer"] for m in loads}
            elif version == 1:  # one buffer of the whole push, its handle sent once; the first push's unmapped
                assert len(loads) == 1 and loads[0]["handle"] is not None and loads[0]["buffer"] not in first
                assert set(sum((m.get("drop", []) for m in messages), [])) == first
                buffer = loads[0]["buffer"]
                assert mapped[-1] == [buffer]
            else:  # the same buffer, no handle: only its id, version and offsets
                assert len(messages) == 1 and messages[0]["buffer"] == buffer and messages[0]["handle"] is None
                assert mapped[-1] == [buffer]
        assert pusher.capacity == metrics[-1]["sync/bytes"] and all(m["sync/tensors"] == len(bucket) for m in metrics)
        assert [m["sync/messages"] for m in metrics] == [3.0, 1.0, 1.0]
        pusher.release(send)
        assert mapped[-1] == [] and pusher.capacity == 0  # the receiver unmapped it
    finally:
        here.send_bytes(b"")
        child.join(30)
    assert child.exitcode == 0


def test_a_late_shm_manager_ack_is_tried_again_and_other_errors_are_not() -> None:
    """torch's shared-memory manager answering after libshm's wait (a loaded machine): the share is tried again,
    at most `SHM_MANAGER_TRIES` times; any other error is raised at the first try."""
    calls: list[int] = []

    def late(times: int, message: str = "Shared memory manager connection has timed out") -> Any:
        def call() -> str:
            calls.append(1)
            if len(calls) <= times:
                raise RuntimeError(message)
            return "shared"

        return call

    assert cuda_ipc.via_shm_manager(late(2)) == "shared" and len(calls) == 3
    calls.clear()
    with pytest.raises(RuntimeError, match="timed out"):
        cuda_ipc.via_shm_manager(late(cuda_ipc.SHM_MANAGER_TRIES))
    assert len(calls) == cuda_ipc.SHM_MANAGER_TRIES
    calls.clear()
    with pytest.raises(RuntimeError, match="No space left"):
        cuda_ipc.via_shm_manager(late(1, "No space left on device"))
    assert len(calls) == 1


def test_a_message_for_a_buffer_never_shared_is_refused() -> None:
    with pytest.raises(RuntimeError, match="weight buffer nope was never shared"):
        cuda_ipc.receive({"buffer": "nope", "handle": None, "version": 1, "meta": b"[]"}, lambda named: None)


def test_the_gpu_is_found_by_uuid_not_by_index() -> None:
    visible = ["GPU-b", "GPU-a"]  # this process sees the sender's GPU at another index
    assert cuda_ipc.local_index("GPU-a", visible) == 1
    with pytest.raises(RuntimeError, match="GPU-c is not among this process's visible GPUs"):
        cuda_ipc.local_index("GPU-c", visible)


def test_the_transport_follows_the_engine_device() -> None:
    assert registry.engine_push(torch.device("cuda", 0).type) == "cuda_ipc"
    assert registry.engine_push(torch.device("cpu").type) == "shm_file"
    assert registry.build_engine_push("cuda_ipc", torch.bfloat16, torch.device("cpu")).__class__ is cuda_ipc.FlatPusher


def test_a_sync_group_with_two_ranks_on_one_gpu_is_refused_in_one_line() -> None:
    distinct_gpus([("trainer source", ["GPU-0"]), ("rollout worker 0", ["GPU-1", "GPU-2"])])  # TP 2, own GPUs
    distinct_gpus([("trainer source", [None]), ("rollout worker 0", [None, None])])  # CPU (gloo): no devices
    with pytest.raises(ValueError, match="Duplicate GPU detected") as err:
        distinct_gpus([("trainer source", ["GPU-0"]), ("rollout worker 0", ["GPU-1"]), ("rollout worker 1", ["GPU-0"])])
    message = str(err.value)
    assert "\n" not in message
    assert "trainer source (sync rank 0)" in message and "rollout worker 1 (sync rank 2)" in message


def test_an_nccl_group_whose_members_disagree_on_cumem_is_refused() -> None:
    same_nccl_cumem([("trainer source", "0"), ("rollout worker 0", "0")])
    with pytest.raises(ValueError, match=r"NCCL_CUMEM_ENABLE differs .*trainer source: unset, rollout worker 0: 0"):
        same_nccl_cumem([("trainer source", None), ("rollout worker 0", "0")])
