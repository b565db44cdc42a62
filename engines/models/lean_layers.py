"""RMSNorm and SwiGLU as autograd functions that keep less for the backward: the update's eager path (the CPU).

Autograd through transformers' Llama RMSNorm keeps the float32 copy of its input (for `pow`'s backward) and the
cast result (for the weight's product): 3 bytes per bf16 input byte, twice a decoder layer. Its SwiGLU keeps the
gate, `silu(gate)` and the up projection. `LeanRMSNorm` keeps only the input and one float32 scale per row, and
recomputes the rest in the backward; `LeanSwiGLU` keeps the gate and the up projection and recomputes `silu`.
On the demo's micro-batches of 1,024 tokens that is ~0.24 GB less at the update's peak (SmolLM2-135M's 30
layers). Their outputs are made again where a backward needs them: the linear layers after a norm (q, k and v's
projections, gate and up's) and the down projection after SwiGLU save their input, which `remade_when_saved` has
autograd keep as how to make it (the same ops on what the norm or the gate keeps anyway), made once when the
backward first asks for it. The forwards run transformers' ops in transformers' order, so their outputs are bitwise
the modules' own (the rollout = trainer log-prob checks stay exact); the backwards are the same math in float32, equal
to autograd's to float32 rounding (tests/engines/models/test_lean_layers.py).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
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
        out = weight * normed.to(x.dtype)
        return keep_recipe(out, lambda: weight * (x.to(torch.float32) * scale).to(x.dtype))

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
        out = torch.nn.functional.silu(gate) * up
        return keep_recipe(out, lambda: torch.nn.functional.silu(gate) * up)

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


class _Remade:
    """What autograd keeps in place of a saved output of the functions above: how to make it, made when a backward
    first asks for it and then shared by the other ops that saved it (q, k and v's projections save one input)."""

    __slots__ = ("make", "made")

    def __init__(self, make: Callable[[], Tensor]) -> None:
        self.make = make
        self.made: Tensor | None = None

    def tensor(self) -> Tensor:
        """The output, made on first use (outside autograd: it is a saved value, not a new graph)."""
        if self.made is None:
            with torch.no_grad():
                self.made = self.make()
        return self.made


# the outputs of the functions above that are still alive, by their storage's address: (the output, its recipe)
_made: dict[int, tuple[weakref.ref[Tensor], _Remade]] = {}


def keep_recipe(out: Tensor, make: Callable[[], Tensor]) -> Tensor:
    """Note how `out` (a fresh contiguous tensor) is made again (`make`: the same ops on tensors kept anyway, or on
    smaller ones), for as long as it lives; returns `out`. Under `remade_when_saved` autograd keeps that instead."""
    if out.numel() and out.is_contiguous() and out.storage_offset() == 0:
        key = out.untyped_storage().data_ptr()

        def forget(ref: weakref.ref[Tensor], key: int = key) -> None:
            if _made.get(key, (None,))[0] is ref:
                del _made[key]

        _made[key] = (weakref.ref(out, forget), _Remade(make))
    return out


def _pack(saved: Tensor) -> Any:
    """A saved remembered output (or a view of one) as its recipe and the view's geometry; anything else as itself."""
    if saved.layout != torch.strided:
        return saved
    entry = _made.get(saved.untyped_storage().data_ptr())
    out = entry[0]() if entry is not None else None
    if entry is None or out is None or out.dtype != saved.dtype or out.device != saved.device:
        return saved
    same = saved.shape == out.shape and saved.stride() == out.stride() and saved.storage_offset() == 0
    return entry[1], None if same else (saved.shape, saved.stride(), saved.storage_offset())


def _unpack(packed: Any) -> Tensor:
    """The saved tensor back: itself, or its output made again (viewed as it was saved)."""
    if isinstance(packed, Tensor):
        return packed
    remade, view = packed
    made = remade.tensor()
    return made if view is None else made.as_strided(*view)


@contextlib.contextmanager
def remade_when_saved() -> Iterator[None]:
    """Within: an op that saves for its backward an output of the functions above keeps how to make it again
    instead (~0.16 GB less at the demo's update peak: the normalised inputs and SwiGLU's output of 30 layers at
    1,024 tokens), the same values bit for bit."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield
