"""The one table of weight transports, and the one place one is chosen: when the workers are built.

`TRANSPORTS` names each `WeightSync` class lazily ("package.module:Class", imported when chosen), so choosing one
imports only it. `CHOICES` maps a run's layout (placement, cluster mode, `cluster.weight_sync`) to a transport, the
first matching row winning; `ENGINE_PUSH` maps a colocated engine's device type to how its own worker processes get
the weights on this node (CUDA IPC on a GPU, shared-memory files on the CPU). A new transport is one class and one
row here (docs/new-backend.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlstages.engines.imports import import_object

if TYPE_CHECKING:  # annotations only: the pre-flight imports this table without torch (the Python 3.12 step)
    import torch

    from rlstages.engines.sync.protocol import WeightSync

TRANSPORTS: dict[str, str] = {
    "hybrid": "rlstages.engines.sync.in_process:HybridSync",  # trainer and engine in one worker: in-process copy
    "in_process": "rlstages.engines.sync.in_process:InProcessSync",  # every engine in the driver (tests)
    "object_store": "rlstages.engines.sync.object_store:ObjectStoreSync",  # split placement through Ray's store
    "collective": "rlstages.engines.sync.collective.driver:CollectiveSync",  # gloo/NCCL group (+ shared memory)
}

ANY = None  # a `CHOICES` key part that matches every value
# (placement: "hybrid" | "split", cluster.mode, cluster.weight_sync) -> transport; the first matching row wins.
CHOICES: tuple[tuple[tuple[str | None, str | None, str | None], str], ...] = (
    (("hybrid", ANY, ANY), "hybrid"),
    (("split", "in_process", ANY), "in_process"),
    (("split", "ray", "object_store"), "object_store"),
    (("split", "ray", ANY), "collective"),  # "collective", "auto"
)

# A colocated engine's device type -> how its own worker processes on this node get the weights; each push class
# has `push(buckets, send)` and `release(send=None)`.
ENGINE_PUSH: dict[str, str] = {"cuda": "cuda_ipc", "cpu": "shm_file"}
ENGINE_PUSHERS: dict[str, str] = {
    "cuda_ipc": "rlstages.engines.sync.cuda_ipc:FlatPusher",  # one persistent device buffer, shared once
    "shm_file": "rlstages.engines.sync.shm_files:ShmFilePush",  # one safetensors file under /dev/shm per bucket
}


def choose_transport(placement: str, mode: str, weight_sync: str) -> str:
    """The transport of a run's layout (`CHOICES`).

    Raises:
        ValueError: no row matches (a placement or mode this table does not know).
    """
    for (want_placement, want_mode, want_sync), name in CHOICES:
        if all(
            w is ANY or w == v for w, v in ((want_placement, placement), (want_mode, mode), (want_sync, weight_sync))
        ):
            return name
    raise ValueError(f"weight sync: no transport for placement={placement!r}, cluster.mode={mode!r}, {weight_sync=}")


def build_weight_sync(name: str, **kwargs: Any) -> WeightSync:
    """A fresh transport `name` of `TRANSPORTS`, its class imported now."""
    if name not in TRANSPORTS:
        raise ValueError(f"weight sync: unknown transport {name!r}; expected one of {sorted(TRANSPORTS)}")
    return import_object(TRANSPORTS[name], field=f"weight sync transport {name!r}")(**kwargs)


def engine_push(device_type: str) -> str:
    """How a colocated engine's worker processes on this node get weights, by the engine's device type
    (`ENGINE_PUSH`; any device but a GPU takes the host-memory path)."""
    return ENGINE_PUSH.get(device_type, ENGINE_PUSH["cpu"])


def build_engine_push(name: str, dtype: torch.dtype, device: torch.device) -> Any:
    """A fresh push `name` of `ENGINE_PUSHERS` casting to `dtype`, its buffers (if any) on `device`."""
    return import_object(ENGINE_PUSHERS[name], field=f"engine push {name!r}")(dtype, device)
