"""Weight gradients summed in place over a step's micro-batches: Megatron-Core's gradient-accumulation fusion,
for the plain-torch backend on any device.

Autograd gives each micro-batch's weight gradient a tensor of its own and `AccumulateGrad` then adds it into
`.grad`: a fresh tensor the size of every weight and a second pass over it, per micro-batch. For a tied
embedding and head (SmolLM2's [49152, 576], 56 MB in bf16) it is worse: the lookup's dense gradient is a zeroed
56 MB tensor with a few hundred rows filled, summed with the head's into a third. Here a linear layer's weight
gradient is added into `.grad` by the GEMM itself (`addmm_`, beta = 1, its sum taken in the kernel's fp32
accumulator: one rounding to bf16 instead of two) and an embedding's rows into their rows (`index_add_`).
In the demo's step-5 update on an AMX Xeon (profiled): `AccumulateGrad`'s adds 444 ms, the tied weight's dense
lookup gradient and its sum with the head's 626 ms, of 6.5 s.

Non-goal: DeepSpeed and Megatron-Core (their own gradient buffers), LoRA (a frozen base), weights of another
dtype than the layer computes in (autocast over fp32 weights: autograd's path is kept).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rlstages.engines.utils import compute_dtype


def add_product_to_grad(param: Tensor, a: Tensor, b: Tensor) -> None:
    """`param.grad += a @ b` by one GEMM that adds into it (`addmm_`), creating the gradient on first use."""
    if param.grad is None:
        param.grad = a.mm(b)
    else:
        param.grad.addmm_(a, b)


class _InPlaceLinearFn(torch.autograd.Function):
    """y = x Wᵀ + b as `F.linear` computes it; the backward adds x's rows' gradient product into `W.grad`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        x = x.to(weight.dtype)  # under autocast the layer's input is cast as F.linear would cast it
        with torch.autocast(x.device.type, enabled=False):
            out = F.linear(x, weight, bias)
        ctx.save_for_backward(x)
        # the parameter itself, not a saved copy of it: its .grad is what the backward adds into (a tensor unpacked
        # from autograd's saved variables may be another object, e.g. under `saved_tensors_hooks`)
        ctx.weight, ctx.has_bias = weight, bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        (x,) = ctx.saved_tensors
        weight: Tensor = ctx.weight
        grad = grad.to(weight.dtype)
        g = grad.reshape(-1, grad.shape[-1])
        gx = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            add_product_to_grad(weight, g.t(), x.reshape(-1, x.shape[-1]))
        gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, None, gb


class InPlaceGradLinear(torch.nn.Linear):
    """An `nn.Linear` (same parameters, same state dict) whose weight gradient adds into `weight.grad` in place."""

    def forward(self, x: Tensor) -> Tensor:
        """The layer's x Wᵀ + b; autograd's own path where it computes in another dtype than its weight's."""
        if compute_dtype(x) != self.weight.dtype or not torch.is_grad_enabled():
            return super().forward(x)
        return _InPlaceLinearFn.apply(x, self.weight, self.bias)


class _InPlaceEmbeddingFn(torch.autograd.Function):
    """The rows of `weight` at `ids`; the backward adds each row's gradient into its row of `weight.grad` and
    gives autograd none for the weight (which stays an input only so that the rows need a gradient)."""

    @staticmethod
    def forward(ctx: Any, ids: Tensor, weight: Tensor, padding_idx: int | None) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx  # a leaf parameter: no reference cycle
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:
        (ids,) = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        flat = ids.reshape(-1)
        if ctx.padding_idx is not None:  # as F.embedding: the padding row gets no gradient
            rows = rows.masked_fill((flat == ctx.padding_idx).unsqueeze(1), 0)
        weight: Tensor = ctx.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
        weight.grad.index_add_(0, flat, rows.to(weight.dtype))
        return None, None, None


class InPlaceGradEmbedding(torch.nn.Embedding):
    """An `nn.Embedding` (same parameters) whose gradient rows add into `weight.grad` in place."""

    def forward(self, ids: Tensor) -> Tensor:
        """The rows of the table at `ids`."""
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(ids)
        out: Tensor = _InPlaceEmbeddingFn.apply(ids, self.weight, self.padding_idx)
        return out


def accumulate_in_place(model: torch.nn.Module) -> dict[str, int]:
    """Make `model`'s plain `nn.Linear` and `nn.Embedding` layers add their weight gradients in place
    (`InPlaceGradLinear`, `InPlaceGradEmbedding`; an embedding with `max_norm`, `scale_grad_by_freq` or sparse
    gradients is left as it is), and tell a layer of its own autograd that can (a class attribute `grad_in_place`:
    the fp32 kernel's) to; returns how many of each, in place."""
    counts = {"linear": 0, "embedding": 0}
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = InPlaceGradLinear
            counts["linear"] += 1
        elif isinstance(getattr(type(module), "grad_in_place", None), bool):
            setattr(module, "grad_in_place", True)  # noqa: B010  # any such layer, not one class
            counts["linear"] += 1
        elif type(module) is torch.nn.Embedding and not (module.max_norm or module.scale_grad_by_freq or module.sparse):
            module.__class__ = InPlaceGradEmbedding
            counts["embedding"] += 1
    return counts
