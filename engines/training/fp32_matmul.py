"""bf16 linear layers whose matmuls run on the fp32 kernel: the same math, faster on CPUs without AMX.

A bf16 x bf16 product is exact in fp32, and CPU bf16 GEMMs accumulate in fp32, so upcasting both operands
and calling the fp32 GEMM computes the same sums (in another order); only the kernel differs. Inputs,
outputs, saved activations and gradients stay bf16, so memory is unchanged: each weight is upcast where it
is used (forward, and again in backward), a block of rows at a time, and freed at once.

The attention's own products (scores and the weighted sum of values: batched matmuls over activations, no
weights) go the same way: the model's eager or sdpa attention is called on fp32 copies of q, k, v and its
output cast back (`FP32_ATTENTION`). On an AVX2 EPYC they were a quarter of a demo update's time in bf16
(8.8 of 37.4 s of CPU for attention's ~3 % of the FLOPs, docs/demo-measured.md).

Which kernel is faster depends on the CPU, and its flags do not tell: two AVX-512-BF16 machines without AMX
measured fp32 327 vs bf16 168 GFLOP/s (an Intel VM) and fp32 203 vs bf16 798 (an AMD EPYC). So `auto` times
both on a layer-sized GEMM once per process (`fp32_kernel_speedup`) and takes the fp32 kernel only when it is
clearly faster; with AMX (`amx_bf16`) the bf16 kernel always wins and nothing is timed.

Non-goal: GPUs (their bf16 tensor cores always win; `auto` keeps them native).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from rlstages.engines.utils import compute_dtype

log = logging.getLogger(__name__)

BLOCK = 4096  # output features per GEMM: a wide layer (the 49k-vocabulary head) never has a full fp32 copy
CLEARLY_FASTER = 1.25  # `auto` takes the fp32 kernel when the bf16 GEMM takes at least this much longer


_SCRATCH = threading.local()  # this thread's kept fp32 buffers, by use: "x", "w", "g", "y"


def _kept(use: str, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """A float32 tensor of `shape` on `like`'s device: on the CPU this thread's buffer for `use`, kept between calls
    and grown when too small. A fresh multi-MB tensor at each call (the head's weight blocks, 9.4 MB) is
    page-faulted anew under jemalloc, the workers' allocator: the update's upcasts took 2.6 of 18.6 s on an AVX2
    EPYC. The caller copies what it keeps out of it before the next call for the same use."""
    if like.device.type != "cpu":
        return torch.empty(shape, dtype=torch.float32, device=like.device)
    need = shape[0] * shape[1]
    buf = getattr(_SCRATCH, use, None)
    if buf is None or buf.numel() < need:
        buf = torch.empty(need, dtype=torch.float32)
        setattr(_SCRATCH, use, buf)
    return buf[:need].view(shape)


def _fp32(t: torch.Tensor, use: str) -> torch.Tensor:
    """A 2-D `t` in float32: itself where it is already, else copied into the kept buffer for `use` (`_kept`)."""
    if t.dtype == torch.float32:
        return t
    return _kept(use, (t.shape[0], t.shape[1]), t).copy_(t)


class _Fp32KernelLinearFn(torch.autograd.Function):
    """y = x Wᵀ + b with operands upcast to fp32 for the GEMM, block by block of output features, and each
    block's result cast back to the compute dtype: the transient fp32 tensors are one block's weights and
    outputs, not the whole layer's (the head's fp32 logits would be 200 MB for 1024 tokens). `in_place`: the
    weight's gradient is added into `weight.grad` block by block (`grad_accumulation`), not returned."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, in_place: bool = False
    ) -> torch.Tensor:
        out_dtype = compute_dtype(x)  # x is on the CPU: its autocast's dtype
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.param = weight if in_place else None  # the parameter whose .grad the backward sums into
        with torch.autocast("cpu", enabled=False):  # plain matmuls: F.linear may be patched (DeepSpeed ZeRO-3)
            x32 = _fp32(x.reshape(-1, x.shape[-1]), "x")
            y = x.new_empty(x32.shape[0], weight.shape[0], dtype=out_dtype)
            for start in range(0, weight.shape[0], BLOCK):
                stop = start + BLOCK
                w32 = _fp32(weight[start:stop], "w")
                block = torch.mm(x32, w32.t(), out=_kept("y", (x32.shape[0], w32.shape[0]), x32))
                y[:, start:stop] = block if bias is None else block + bias[start:stop].float()
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        with torch.autocast("cpu", enabled=False):
            x32 = _fp32(x.reshape(-1, x.shape[-1]), "x")
            g = grad.reshape(-1, grad.shape[-1])
            gx = torch.zeros(x32.shape, dtype=torch.float32, device=x.device) if need_x else None
            param = ctx.param
            summed = param is not None and param.grad is not None  # a later micro-batch: its blocks add into the sum
            gw = (param.grad if summed else torch.empty_like(weight)) if need_w else None
            gb = torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device) if need_b else None
            for start in range(0, weight.shape[0], BLOCK):
                stop = start + BLOCK
                g32 = _fp32(g[:, start:stop], "g")
                if gx is not None:
                    gx.addmm_(g32, _fp32(weight[start:stop], "w"))
                if gw is not None:
                    block = torch.mm(g32.t(), x32, out=_kept("y", (g32.shape[1], x32.shape[1]), x32))
                    if summed:  # rounded once into the sum
                        gw[start:stop].add_(block)
                    else:
                        gw[start:stop] = block
                if gb is not None:
                    gb[start:stop] = g32.sum(0)
        if param is not None and gw is not None and not summed:
            param.grad = gw  # the first micro-batch's gradient is the sum so far
        gx_out = None if gx is None else gx.reshape(x.shape).to(x.dtype)
        return gx_out, None if param is not None else gw, gb, None


class Fp32KernelLinear(torch.nn.Linear):
    """An `nn.Linear` (same parameters, same state dict) whose matmuls run on the fp32 kernel."""

    grad_in_place = False  # set by `grad_accumulation.accumulate_in_place`: the weight's gradient summed in .grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output, x Wᵀ + b, through the fp32 GEMM, in the dtype the native layer returns."""
        return _Fp32KernelLinearFn.apply(x, self.weight, self.bias, self.grad_in_place)


FP32_ATTENTION = {"eager": "rlstages_fp32_eager", "sdpa": "rlstages_fp32_sdpa"}  # transformers name -> ours


def _eager_of(module: torch.nn.Module) -> Any:
    """The eager attention function of the model file that defines `module` (each transformers model has its
    own `eager_attention_forward`: softcapping, sinks), or None."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _fp32_attention(base: str) -> Any:
    """A transformers attention function that runs `base` ("eager" or "sdpa") on fp32 copies of q, k, v (and of
    an additive mask) and returns its output in q's dtype; autograd takes the gradients back through the casts."""

    def attention(
        module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, None]:
        if base == "sdpa":
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as fn
        else:
            fn = _eager_of(module)
        if mask is not None and mask.is_floating_point():
            mask = mask.float()
        out, _ = fn(module, query.float(), key.float(), value.float(), mask, **kwargs)
        return out.to(query.dtype), None

    return attention


def use_fp32_attention(model: torch.nn.Module) -> str | None:
    """Switch a transformers model's eager or sdpa attention to its fp32 variant (`FP32_ATTENTION`), in place;
    returns the new name, or None where the model has another attention or an attention module whose file has no
    eager function of its own."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    switch = getattr(model, "set_attn_implementation", None)
    if current not in FP32_ATTENTION or not callable(switch):
        return None
    attentions = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    if current == "eager" and not all(_eager_of(m) for m in attentions):  # each is called with its own file's
        return None
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = FP32_ATTENTION[current]
    AttentionInterface.register(name, _fp32_attention(current))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])  # the same masks as the native one
    switch(name)
    return name


def use_fp32_kernel(model: torch.nn.Module) -> int:
    """Make every `nn.Linear` of `model` (LoRA's adapters included, when called after wrapping) an
    `Fp32KernelLinear` and its attention fp32 (`use_fp32_attention`), in place (weights untouched); returns how
    many layers were swapped."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = Fp32KernelLinear
            count += 1
    attention = use_fp32_attention(model)
    log.info("fp32 kernel: %d linear layers, attention %s", count, attention or "unchanged")
    return count


@functools.cache
def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has AMX's bf16 tiles (`amx_bf16` among the kernel's CPU flags; False where unknown)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "amx_bf16" in line.split() for line in text.splitlines())


@functools.cache
def fp32_kernel_speedup(threads: int, rows: int = 512, features: int = 1024, rounds: int = 5) -> float:
    """The bf16 GEMM's time over the fp32 kernel's (the layer's upcasts included) on a `rows` x `features`
    by `features` x `features` product with `threads` threads; each the best of `rounds` interleaved timings,
    so a passing load slows both and the best times are the quiet ones. Above 1: the fp32 kernel is faster."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(rows, features, generator=gen).bfloat16()
        w = (torch.randn(features, features, generator=gen) / features**0.5).bfloat16()
        kernels = {"bf16": lambda: torch.mm(x, w.t()), "fp32": lambda: _Fp32KernelLinearFn.apply(x, w, None, False)}
        best = dict.fromkeys(kernels, float("inf"))
        with torch.no_grad():
            for kernel in kernels.values():  # warm-up: oneDNN's first call of a shape sets up its kernel
                kernel()
            for _ in range(rounds):
                for name, kernel in kernels.items():
                    start = time.perf_counter()
                    kernel()
                    best[name] = min(best[name], time.perf_counter() - start)
        return best["bf16"] / best["fp32"]
    finally:
        torch.set_num_threads(previous)


def wants_fp32_kernel(setting: bool | str, computes_in_bf16: bool, device: torch.device) -> bool:
    """Resolve `fp32_matmul` (True, False or "auto": where this CPU has no AMX and its fp32 kernel timed
    clearly faster than its bf16 GEMM) for a model on `device` that computes in bf16 or not."""
    if not computes_in_bf16 or device.type != "cpu" or setting is False:
        return False
    if setting is True:
        return True
    if cpu_has_amx():
        return False
    speedup = fp32_kernel_speedup(torch.get_num_threads())
    chosen = speedup >= CLEARLY_FASTER
    _say_choice(speedup, "fp32" if chosen else "bf16")
    return chosen


@functools.cache
def _say_choice(speedup: float, kernel: str) -> None:
    """The auto choice's line, once per process and outcome (the rollout asks at every generation)."""
    log.info("fp32_matmul auto: the fp32 GEMM is %.2fx as fast as the bf16 one here -> %s", speedup, kernel)
