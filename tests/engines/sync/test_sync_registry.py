"""The weight transports' one table (`engines.sync.registry`): every layout maps to one transport, every entry
builds a `WeightSync`, and the one bucketizer every transport shares (`engines.sync.buckets.group_buckets`) cuts a
stream as documented. CPU only, no Ray: the transports' rounds run in test_actor_group.py (object store, in-process),
test_hybrid.py, test_weight_sync_collective.py, test_flat_sync.py and test_cuda_ipc.py.
"""

from __future__ import annotations

import pytest
import torch

from rlstages.engines.sync import registry
from rlstages.engines.sync.buckets import group_buckets, tensor_buckets
from rlstages.engines.sync.protocol import WeightSync


@pytest.mark.parametrize(
    ("placement", "mode", "weight_sync", "expected"),
    [
        ("hybrid", "ray", "auto", "hybrid"),
        ("hybrid", "in_process", "object_store", "hybrid"),
        ("split", "in_process", "collective", "in_process"),
        ("split", "ray", "object_store", "object_store"),
        ("split", "ray", "collective", "collective"),
        ("split", "ray", "auto", "collective"),
    ],
)
def test_each_layout_has_one_transport(placement: str, mode: str, weight_sync: str, expected: str) -> None:
    assert registry.choose_transport(placement, mode, weight_sync) == expected


def test_an_unknown_layout_or_name_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="no transport for placement='colocated'"):
        registry.choose_transport("colocated", "ray", "auto")
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'"):
        registry.build_weight_sync("carrier-pigeon")


@pytest.mark.parametrize("name", sorted(registry.TRANSPORTS))
def test_every_entry_builds_a_weight_sync(name: str) -> None:
    transport = registry.build_weight_sync(name)
    assert isinstance(transport, WeightSync), name
    assert name in {chosen for _, chosen in registry.CHOICES}, f"{name} is chosen by no layout"


def test_engine_push_by_device() -> None:
    assert registry.engine_push("cuda") == "cuda_ipc"
    assert registry.engine_push("cpu") == registry.engine_push("mps") == "shm_file"


def test_the_bucketizer_keeps_order_and_size_and_pulls_lazily() -> None:
    sizes = [3, 4, 2, 9, 1, 1, 5]
    pulled: list[int] = []

    def stream():
        for i, n in enumerate(sizes):
            pulled.append(i)
            yield f"t{i}", n

    groups = group_buckets(stream(), 6, lambda n: n)
    first = next(groups)
    assert first == [("t0", 3)] and pulled == [0, 1]  # t1 would overflow: the first bucket closes before it
    rest = list(groups)
    assert [[n for _, n in g] for g in [first, *rest]] == [[3], [4, 2], [9], [1, 1], [5]]  # 9 > 6 goes alone
    assert all(sum(n for _, n in g) <= 6 or len(g) == 1 for g in [first, *rest])


def test_tensor_buckets_are_sized_in_the_travelling_dtype() -> None:
    named = [(f"w{i}", torch.zeros(8)) for i in range(4)]  # 32 bytes each in float32, 16 in bfloat16
    assert [len(b) for b in tensor_buckets(named, 32)] == [1, 1, 1, 1]
    assert [len(b) for b in tensor_buckets(named, 32, torch.bfloat16)] == [2, 2]
