"""The CUDA IPC bucket protocol (`runtime.cuda_ipc`) on the CPU: a bucket packed into one flat payload and read
back bit-exact; its handle made of plain values that survive msgpack (the encoding of vLLM's `collective_rpc`);
the payload mapped by a second process from that handle (torch's shared-memory twin of a CUDA IPC handle) and
every tensor read there bit-exact, in the sender's order, one handle per bucket; the GPU-by-UUID remap; and
split placement's refusal of two sync ranks on one GPU. The CUDA path itself: tests/gpu/test_gpu_weight_sync.py.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import msgpack
import pytest
import torch

from rlstages.engines.runtime import cuda_ipc
from rlstages.engines.runtime.collective_sync import distinct_gpus, same_nccl_cumem


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
    """The second process: map each bucket by its handle, send back the bytes of every tensor in it."""
    while True:
        message = conn.recv_bytes()
        if not message:
            return
        handle, meta = msgpack.unpackb(message)
        seen: list[tuple[str, bytes, str, list[int]]] = []

        def load(named: list[tuple[str, torch.Tensor]], seen: list = seen) -> None:
            seen.extend((n, _bytes(t), str(t.dtype), list(t.shape)) for n, t in named)

        count = cuda_ipc.receive_bucket(handle, meta, load)
        conn.send((count, seen))


def test_a_second_process_maps_each_bucket_by_one_plain_handle() -> None:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(there,), daemon=True)
    child.start()
    bucket = _bucket() + [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(8, 4)) for i in range(3)]
    received: list[tuple[str, bytes, str, list[int]]] = []
    handles: list[dict[str, Any]] = []

    def send(handle: dict[str, Any], meta: bytes) -> int:
        handles.append(handle)
        here.send_bytes(msgpack.packb((handle, meta)))  # plain values only: vLLM's RPC channel carries them
        count, seen = here.recv()
        received.extend(seen)
        return count

    try:
        buckets = [bucket[:2], bucket[2:4], bucket[4:]]
        metrics = cuda_ipc.push_buckets(buckets, torch.bfloat16, torch.device("cpu"), send)
    finally:
        here.send_bytes(b"")
        child.join(30)
    assert metrics["sync/buckets"] == 3 and metrics["sync/tensors"] == len(bucket) and len(handles) == 3
    assert all(h["kind"] == "cpu" and isinstance(h["handle"], bytes) for h in handles)
    assert [n for n, *_ in received] == [n for n, _ in bucket]  # the sender's order, bucket after bucket
    for (name, data, dtype, shape), (_, want) in zip(received, bucket, strict=True):
        assert data == _bytes(want.to(torch.bfloat16)), name
        assert dtype == "torch.bfloat16" and shape == list(want.shape)
    assert child.exitcode == 0


def test_the_gpu_is_found_by_uuid_not_by_index() -> None:
    visible = ["GPU-b", "GPU-a"]  # this process sees the sender's GPU at another index
    assert cuda_ipc.local_index("GPU-a", visible) == 1
    with pytest.raises(RuntimeError, match="GPU-c is not among this process's visible GPUs"):
        cuda_ipc.local_index("GPU-c", visible)


def test_the_transport_follows_the_engine_device() -> None:
    assert cuda_ipc.weight_transport(torch.device("cuda", 0)) == "cuda_ipc"
    assert cuda_ipc.weight_transport(torch.device("cpu")) == "shm_file"


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
