"""Megatron-Core without CUDA: the one place that maps megatron-core's CUDA assumptions to the CPU.

megatron-core assumes CUDA in four places on our path (reference C.8, feasibility §6): RoPE and the local
attention allocate on `torch.cuda.current_device()`, `dist_checkpointing.save` calls
`torch.cuda.synchronize()`, a tied output layer on the last pipeline stage is moved with `.cuda()` before
its all-reduce, and the model-parallel RNG tracker reads CUDA RNG state. `apply_cpu_shim` patches the
first three, only when this worker computes on the CPU (the device handed to `apply_cpu_shim`: where each of
them could only raise); `gpt.init_model_parallel` seeds with the inference RNG tracker (its `fork()` is a
null context; dropout draws from the CPU RNG).
Training adds a fifth place: the optimizer, gradient clipping and the pipeline schedules allocate small
tensors with a literal `device="cuda"` and assert `tensor.type() == "torch.cuda.FloatTensor"`;
`cuda_as_cpu()` is a scoped torch function mode that maps those to the CPU while it is active.
Mixture-of-Experts adds two (`apply_moe_shim`): megatron-core 0.16's router GEMM reads `te_general_gemm`, which is
unbound when Transformer Engine is absent (a NameError on any machine without TE: `moe_model` sets it to None,
megatron's own fallback); and the alltoall token dispatcher copies its split sizes device-to-host on a side
CUDA stream, then passes them to `all_to_all_single`, which takes lists, not CPU tensors: without CUDA its
dtoh step becomes "split sizes to numpy" and no stream is made.
Without Transformer Engine or Apex megatron-core builds its norms as torch's (`WrappedTorchNorm`), which refuses
sequence parallelism only because it does not tag its weights for the TP gradient all-reduce that sequence-parallel
norms need; `apply_torch_norm_sp_shim` tags them (`param.sequence_parallel`, as Transformer Engine's norms do), so
`finalize_model_grads` sums their gradients over the TP group. Sequence parallelism is what megatron-core requires
to train an MoE model under TP > 1 (each TP rank routes its own share of the tokens).
On a GPU every function here is a no-op, except the TE-absent router and norm fixes. Non-goal: building models or
process groups (`gpt.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rlstages.engines.runtime.device import on_cuda

_SHIM_APPLIED = False
_ON_CUDA: bool | None = None  # this process's device, as `apply_cpu_shim` was handed it (megatron-core's set-up)


def computes_on_cuda() -> bool:
    """Whether this process's megatron-core runs on CUDA: the device its worker resolved where it started, handed
    to `gpt.init_model_parallel` (megatron-core's state is per process, so is this)."""
    if _ON_CUDA is None:
        raise RuntimeError("megatron-core is not set up in this process (gpt.init_model_parallel first)")
    return _ON_CUDA


def apply_cpu_shim(device: torch.device) -> bool:
    """Record this process's `device`; on the CPU point megatron-core's CUDA device lookups at it (idempotent).

    Returns True when the shim is (now) active.
    """
    global _SHIM_APPLIED, _ON_CUDA
    _ON_CUDA = on_cuda(device)
    if _ON_CUDA:
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
    """While active (and only on a CPU worker), megatron-core's literal CUDA allocations and type checks see the CPU.

    Wrap megatron-core calls that hard-code CUDA: optimizer construction / step / state dicts, and the
    pipeline schedules. A no-op context on a CUDA worker.
    """
    if computes_on_cuda():
        yield
        return
    with _CudaAsCpuMode():
        yield


class _NoStream:
    """Stands in for the alltoall dispatcher's class-level dtoh CUDA stream (never used on the CPU)."""


def _splits_to_numpy(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
    """CPU version of `MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`: what it moves to the host is
    already there; the all-to-all split sizes become numpy arrays, as the CUDA path leaves them."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def apply_moe_shim() -> None:
    """megatron-core MoE without Transformer Engine (router GEMM fallback) and without CUDA (alltoall dispatcher
    over gloo); idempotent."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from rlstages.engines.megatron.moe_model import define_missing_te_symbols

    define_missing_te_symbols()
    if computes_on_cuda():
        return
    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _splits_to_numpy  # type: ignore[method-assign]


_NORM_SHIM_APPLIED = False


def apply_torch_norm_sp_shim() -> None:
    """Let megatron-core's torch norm fallback run under sequence parallelism: built as without it, its parameters
    tagged `sequence_parallel` (their gradients then summed over the TP group); idempotent."""
    global _NORM_SHIM_APPLIED
    if _NORM_SHIM_APPLIED:
        return
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    def new(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        plain = copy.copy(config)  # the same config without the flag the torch wrapper asserts against
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = new  # type: ignore[method-assign]
    _NORM_SHIM_APPLIED = True
