"""RMSNorm and SwiGLU as autograd functions that keep less for the backward: the update's eager path (the CPU).

Autograd through transformers' Llama RMSNorm keeps the float32 copy of its input (for `pow`'s backward) and the
cast result (for the weight's product): 3 bytes per bf16 input byte, twice a decoder layer. Its SwiGLU keeps the
gate, `silu(gate)` and the up projection. `LeanRMSNorm` keeps only the input and one float32 scale per row, and
recomputes the rest in the backward; `LeanSwiGLU` keeps the gate and the up projection and recomputes `silu`.
On the demo's micro-batches of 1,024 tokens that is ~0.24 GB less at the update's peak (SmolLM2-135M's 30
layers). The forwards run transformers' ops in transformers' order, so their outputs are bitwise the modules'
own (the rollout = trainer log-prob checks stay exact); the backwards are the same math in float32, equal to
autograd's to float32 rounding (tests/engines/models/test_lean_layers.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _normalised(h: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Llama's RMSNorm in float32: `h` times the reciprocal root mean square of its last dim, and that scale."""
    scale = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h * scale, scale


class LeanRMSNorm(torch.autograd.Function):
    """`weight * (x in float32, normalised by its root mean square).to(x.dtype)`; saves `x` and the row scales."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """The ops of transformers' module in its order; keeps `x`, `weight` and the row scales."""
        normed, scale = _normalised(x.to(torch.float32), eps)
        ctx.save_for_backward(x, weight, scale)
        return weight * normed.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        """The gradients of `x` and `weight`, the float32 rows recomputed from `x`."""
        x, weight, scale = ctx.saved_tensors
        h = x.to(torch.float32)
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            cast = (h * scale).to(x.dtype)
            grad_w = (grad * cast).sum_to_size(weight.shape)
        if ctx.needs_input_grad[0]:
            g = (grad * weight).to(torch.float32)  # the gradient at the float32 normalised rows
            # d/dh of h * rsqrt(mean(h^2) + eps): scale * g - h * scale^3 * mean(g * h)
            coef = (g * h).mean(-1, keepdim=True) * scale.pow(3)
            grad_x = torch.addcmul(g * scale, h, coef, value=-1.0).to(x.dtype)
        return grad_x, grad_w, None


class LeanSwiGLU(torch.autograd.Function):
    """`silu(gate) * up`; saves `gate` and `up`, recomputes `silu(gate)` in the backward."""

    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        """`silu(gate) * up`; keeps `gate` and `up`."""
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """The gradients of `gate` and `up`, `silu(gate)` recomputed."""
        gate, up = ctx.saved_tensors
        act = torch.nn.functional.silu(gate)
        grad_gate = grad_up = None
        if ctx.needs_input_grad[1]:
            grad_up = grad * act
        if ctx.needs_input_grad[0]:
            # silu'(x) = sigmoid(x) * (1 + x * (1 - sigmoid(x))), as autograd's SiluBackward computes it
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad_up


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The RMSNorm of transformers' Llama through `LeanRMSNorm` (its output bitwise; less kept for the backward)."""
    return LeanRMSNorm.apply(x, weight, eps)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's gate `silu(gate) * up` through `LeanSwiGLU`."""
    return LeanSwiGLU.apply(gate, up)
