"""Where a worker computes, in one place: CUDA when Ray gave the actor a GPU, the CPU otherwise.

A worker resolves its device once, where it starts: the engine an actor is built around (`PPOTrainer`, a rollout
engine, the reward model, `HybridEngine`, which passes its device to the trainer and rollout it holds) calls
`worker_device()` in its constructor unless it was handed one, and passes it down to everything it builds (step
backends, Megatron's set-up, weight-sync receivers, RNG restore, profilers); nothing else in `engines/` decides
between CUDA and the CPU (`tests/engines/runtime/test_device.py` checks where `worker_device` is called).
The rules (verl `Worker`, OpenRLHF, slime `get_local_gpu_id`):

- `RLSTAGES_DEVICE` (cpu, cuda, cuda:N) overrides everything (a test comparing CPU and GPU in one process).
- Inside a Ray actor the GPU is the one Ray assigned (`ray.get_gpu_ids()`): Ray narrows
  `CUDA_VISIBLE_DEVICES` to it, so it is `cuda:0` there; under `RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`
  every GPU stays visible and the assigned id is looked up among them. An actor given no GPU computes on the
  CPU even on a GPU node. Actors sharing a GPU (fractional `num_gpus`, colocated roles) get the same device.
- Outside Ray (tests, `cluster.mode: in_process`, scripts) CUDA device 0 when CUDA is available.

`torch.cuda.set_device` runs before the first CUDA allocation, so kernels and NCCL use the right GPU. The rest
of this module is what follows from the device: the torch.distributed backend string, the process env that
must match between trainer and inference engine (`NCCL_CUMEM_ENABLE`) or be set before CUDA starts
(`CUDA_DEVICE_MAX_CONNECTIONS` for Megatron-Core), releasing cached blocks between phases, and memory stats.
On the CPU each of these is a no-op or an empty result, so the CPU path runs the same code.

`visible_gpus()` is the driver's count of this machine's GPUs (pre-flight, `rlstages doctor`).

Non-goals: moving weights between processes (`sync.object_store`, `sync.collective`); several GPUs
per worker (one rank, one GPU).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch

DEVICE_ENV = "RLSTAGES_DEVICE"  # cpu | cuda | cuda:N: overrides the resolution below
NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
NCCL_CUMEM_ENV = "NCCL_CUMEM_ENABLE"
MAX_CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
GB = 1024**3

Moved = TypeVar("Moved")


def resolve_device(
    env: Mapping[str, str], cuda_available: bool, device_count: int, ray_gpu_ids: Sequence[Any] | None
) -> torch.device:
    """The device of a worker from its environment, without touching CUDA (the logic `worker_device` runs).

    `ray_gpu_ids`: `ray.get_gpu_ids()` inside a Ray actor, None outside Ray. Raises with the ids when the GPU
    Ray assigned is not among the visible ones (a mis-narrowed `CUDA_VISIBLE_DEVICES`)."""
    forced = env.get(DEVICE_ENV, "").strip()
    if forced:
        device = torch.device(forced)
        if device.type == "cuda" and not cuda_available:
            raise RuntimeError(f"{DEVICE_ENV}={forced} but CUDA is not available in this process")
        return torch.device("cuda", device.index or 0) if device.type == "cuda" else device
    if not cuda_available or device_count == 0:
        return torch.device("cpu")
    if ray_gpu_ids is None:  # not a Ray actor
        return torch.device("cuda", 0)
    if not ray_gpu_ids:  # an actor Ray gave no GPU
        return torch.device("cpu")
    assigned = str(ray_gpu_ids[0])
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:  # nothing narrowed: the id is the physical index
        index = int(assigned)
    elif assigned in visible:  # narrowed by Ray (index 0), or not narrowed under NOSET (its position)
        index = visible.index(assigned)
    else:
        raise RuntimeError(
            f"Ray assigned GPU {assigned} but CUDA_VISIBLE_DEVICES={','.join(visible)} does not list it "
            f"({NOSET_ENV}={env.get(NOSET_ENV, 'unset')})"
        )
    if index >= device_count:
        raise RuntimeError(f"GPU index {index} (Ray id {assigned}) but only {device_count} CUDA devices are visible")
    return torch.device("cuda", index)


def _ray_gpu_ids() -> list[Any] | None:
    """`ray.get_gpu_ids()` inside a Ray actor (where engines run); None in a driver or without Ray (this never
    imports Ray: a process that has not imported it is no actor)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return None
    return list(ray.get_gpu_ids())


def _this_worker() -> torch.device:
    cuda = torch.cuda.is_available()  # the one place in engines/ that asks
    return resolve_device(os.environ, cuda, torch.cuda.device_count() if cuda else 0, _ray_gpu_ids())


def worker_device() -> torch.device:
    """Where this worker computes: its CUDA device (made current with `torch.cuda.set_device`) or the CPU."""
    device = _this_worker()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def local_device() -> torch.device:
    """Where a process started here outside Ray would compute (CUDA device 0, else the CPU), without making it
    current: the driver's reports of this machine (`rlstages doctor`, the console's header). Never a worker's."""
    return _this_worker()


def on_cuda(device: torch.device) -> bool:
    """Whether `device` (the worker's, resolved once where it starts and passed down) is a CUDA device. An actor
    Ray gave no GPU computes on the CPU even on a GPU node: its device says so."""
    return device.type == "cuda"


def visible_gpus() -> int:
    """GPUs a process started on this machine would see (the driver's checks: pre-flight, `rlstages doctor`):
    torch's CUDA devices, else `nvidia-smi -L`'s (a CPU-only torch beside a GPU driver), within
    CUDA_VISIBLE_DEVICES. Does not start CUDA in the calling process."""
    count = torch.cuda.device_count()
    if count == 0 and shutil.which("nvidia-smi"):
        try:
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False)
        except (OSError, subprocess.SubprocessError):
            return 0
        count = sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            count = min(count, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))
    return count


def to_device(obj: Moved, device: torch.device, non_blocking: bool = False) -> Moved:
    """A tensor, TensorDict, or dict / list / tuple of them on `device` (the same object where it is there)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=non_blocking)  # type: ignore[return-value]
    if hasattr(obj, "to") and hasattr(obj, "batch_size"):  # a TensorDict (its device None: mixed or unset)
        leaves = obj.values(include_nested=True, leaves_only=True)  # type: ignore[attr-defined]
        if obj.device == device or all(t.device == device for t in leaves):  # type: ignore[attr-defined]
            return obj
        return obj.to(device, non_blocking=non_blocking)  # type: ignore[attr-defined]
    if isinstance(obj, dict):
        return {k: to_device(v, device, non_blocking) for k, v in obj.items()}  # type: ignore[return-value]
    if isinstance(obj, list | tuple):
        return type(obj)(to_device(v, device, non_blocking) for v in obj)  # type: ignore[return-value]
    return obj


def to_host(obj: Moved) -> Moved:
    """`to_device(obj, cpu)`: what leaves a worker (Ray results) is on the CPU, never a CUDA tensor."""
    return to_device(obj, torch.device("cpu"))


def dist_backend(device: torch.device, cpu_collectives: bool = True) -> str:
    """The torch.distributed backend of a worker on `device`: gloo on the CPU; on CUDA NCCL for tensors, with
    gloo beside it for CPU tensors and object collectives (`cpu:gloo,cuda:nccl`) unless `cpu_collectives` is
    False (plain `nccl`, e.g. for DeepSpeed, whose collectives are all on the device)."""
    if device.type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_collectives else "nccl"


def gpu_env(nccl_cumem_enable: bool | None = None, cuda_device_max_connections: int | None = None) -> dict[str, str]:
    """Process env of a GPU worker from the config: `NCCL_CUMEM_ENABLE` (give trainer and inference engine the
    same value: NCCL's cuMem allocator in one and not the other breaks their shared groups) and
    `CUDA_DEVICE_MAX_CONNECTIONS`; unset options are left out (the libraries' defaults)."""
    env: dict[str, str] = {}
    if nccl_cumem_enable is not None:
        env[NCCL_CUMEM_ENV] = "1" if nccl_cumem_enable else "0"
    if cuda_device_max_connections is not None:
        env[MAX_CONNECTIONS_ENV] = str(cuda_device_max_connections)
    return env


def set_env_defaults(env: Mapping[str, str]) -> None:
    """Set each variable unless the process already has it (the user's config wins). Call before
    `worker_device`: CUDA reads e.g. `CUDA_DEVICE_MAX_CONNECTIONS` once, when its context starts."""
    for key, value in env.items():
        os.environ.setdefault(key, value)


def free_cached(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back to the GPU between phases (generation's KV cache before
    the update, the update's activations before generation); nothing to do on the CPU."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new window for `device_memory_stats`' peaks (call at the start of a step)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_memory_stats(device: torch.device) -> dict[str, float]:
    """GPU memory in GB since the last `reset_peak_memory`: peak allocated and reserved by torch, and used on
    the whole device (`mem_get_info`: total - free, which also sees vLLM's and NCCL's allocations). Empty on
    the CPU (no device memory to report)."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {
        "max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / GB,
        "max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / GB,
        "memory_used_gb": (total - free) / GB,
    }


def device_name(device: torch.device) -> str:
    """The device's marketing name (`NVIDIA H100 80GB HBM3`), or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (before reading a wall clock); nothing to do on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
