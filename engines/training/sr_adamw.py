"""AdamW for bf16 weights with stochastic rounding (`actor.bf16_stochastic_round`): fp32 math per tensor, moments
kept in bf16, each new weight rounded to one of its two bf16 neighbours with probability by its distance to each
(unbiased), so updates far below bf16's resolution still move the weights on average.

The random bits are a hash of (seed, step, tensor, element index) computed inside the compiled per-tensor step,
not drawn from a generator: `torch.randint` inside a compiled CPU kernel costs ~10 ns an element (torchao's
`_AdamW` draws them so: 1.3 s of its 1.6 s step for 135M parameters on the AMX Xeon, docs/demo-measured.md), the
hash ~1 ns; and a resumed run rounds as the uninterrupted one does with no generator state to keep. The step is
compiled on first use (`engines.compiled.CompiledFunctions`: inductor's C++ loop on CPU); where it cannot compile
it runs eagerly, the same arithmetic, with one line saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from rlstages.engines.compiled import CompiledFunctions

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1  # spreads consecutive element indices over the hash's input space


def hash32(x: Tensor) -> Tensor:
    """A well-mixed 32-bit hash of each int64 element (Wellons' lowbias32), in [0, 2^32)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def round_to_bf16(x: Tensor, key: Tensor) -> Tensor:
    """fp32 `x` rounded to bf16 stochastically: up (away from zero) with probability its low 16 bits / 2^16, the
    bits from `hash32(element index, key)`; returned as the fp32 bit pattern of the chosen bf16 value."""
    index = torch.arange(x.numel(), dtype=torch.int64, device=x.device).view(x.shape)
    draw = hash32(index * _GOLDEN + key) & 0xFFFF
    bits = x.view(torch.int32)
    towards_zero = bits & -65536  # the upper 16 bits: bf16 rounded towards zero
    up = torch.where(draw.to(torch.int32) < (bits & 0xFFFF), towards_zero + 0x10000, towards_zero)
    return up.view(torch.float32)


def adamw_bf16_step(
    p: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: Tensor,
    lr: Tensor,
    key: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> Tensor:
    """One AdamW update of bf16 `p` in fp32 (decoupled weight decay, bias-corrected moments), written back to the
    bf16 moments and, stochastically rounded (`round_to_bf16`), to `p`; returns `p`."""
    p32 = p.float()
    g32 = grad.float()
    p32 = p32 - lr * weight_decay * p32
    m = exp_avg.float().lerp(g32, 1 - beta1)
    v = exp_avg_sq.float().lerp(g32.square(), 1 - beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    denom = v.sqrt() / (1 - beta2**step).sqrt() + eps
    p32 = p32 - lr * (m / (1 - beta1**step)) / denom
    return p.copy_(round_to_bf16(p32, key))


KERNELS = CompiledFunctions({"adamw_bf16_step": adamw_bf16_step}, "bf16 AdamW", devices=("cpu", "cuda"))


def step_key(seed: int, step: int, index: int) -> int:
    """The hash key of tensor `index` at optimizer step `step` of a run seeded `seed` (63 bits)."""
    return (seed * 1_000_003 + step) * 65_537 + index & 0x7FFFFFFFFFFFFFFF


class BF16StochasticAdamW(torch.optim.Optimizer):
    """AdamW over bf16 parameters with stochastic rounding of each update (module docstring). The state keys are
    AdamW's (`step`, `exp_avg`, `exp_avg_sq`; moments in the parameter's dtype)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = seed

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = torch.tensor(float(group["lr"]))
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                key = torch.tensor(step_key(self.seed, int(state["step"]), index), dtype=torch.int64)
                args = (p.detach(), p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr, key,
                        beta1, beta2, group["eps"], group["weight_decay"])  # fmt: skip
                if not KERNELS.takes(p) or KERNELS.run("adamw_bf16_step", *args) is None:
                    adamw_bf16_step(*args)  # the same arithmetic, eagerly
        return loss
