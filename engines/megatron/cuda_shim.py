"""Megatron-Core without CUDA: the one place that maps megatron-core's CUDA assumptions to the CPU.

megatron-core assumes CUDA in four places on our path (reference C.8, feasibility §6): RoPE and the local
attention allocate on `torch.cuda.current_device()`, `dist_checkpointing.save` calls
`torch.cuda.synchronize()`, a tied output layer on the last pipeline stage is moved with `.cuda()` before
its all-reduce, and the model-parallel RNG tracker reads CUDA RNG state. `apply_cpu_shim` patches the
first three, only when CUDA is absent (where each of them could only raise); `gpt.init_model_parallel` seeds
with the inference RNG tracker (its `fork()` is a null context; dropout draws from the CPU RNG).
Training adds a fifth place: the optimizer, gradient clipping and the pipeline schedules allocate small
tensors with a literal `device="cuda"` and assert `tensor.type() == "torch.cuda.FloatTensor"`;
`cuda_as_cpu()` is a scoped torch function mode that maps those to the CPU while it is active.
On a GPU every function here is a no-op. Non-goal: building models or process groups (`gpt.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_SHIM_APPLIED = False


def apply_cpu_shim() -> bool:
    """Point megatron-core's CUDA device lookups at the CPU; idempotent, a no-op when CUDA is available.

    Returns True when the shim is (now) active.
    """
    global _SHIM_APPLIED
    if torch.cuda.is_available():
        return False
    if not _SHIM_APPLIED:
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]  # RoPE, attention buffers
        torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]  # dist_checkpointing.save
        torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]  # tied output, PP>1
        _SHIM_APPLIED = True
    return True


class _CudaAsCpuMode(torch.overrides.TorchFunctionMode):
    """Rewrites `device="cuda"` arguments to the CPU and reports CPU tensors' `.type()` as CUDA types."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if isinstance(device, str | torch.device) and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_as_cpu() -> Iterator[None]:
    """While active (and only without CUDA), megatron-core's literal CUDA allocations and type checks see the CPU.

    Wrap megatron-core calls that hard-code CUDA: optimizer construction / step / state dicts, and the
    pipeline schedules. A no-op context when CUDA is available.
    """
    if torch.cuda.is_available():
        yield
        return
    apply_cpu_shim()
    with _CudaAsCpuMode():
        yield
