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

_GOLDEN = 0x9E3779B1  # spreads consecutive element indices over the hash's input space


def _int32(value: int) -> int:
    """`value`'s low 32 bits as a signed int32 (the bit pattern int32 lanes multiply by)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def hash32(x: Tensor) -> Tensor:
    """Wellons' lowbias32 of each int32 element, as an int32 bit pattern: the multiplies wrap around as uint32's
    do (the low 32 bits of any product are the same signed or not) and each right shift is masked to be logical.
    int32 lanes: twice as many per vector as int64 and a native multiply (int64's is emulated or slow)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _int32(0x7FEB352D)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _int32(0x846CA68B)
    return x ^ ((x >> 16) & 0xFFFF)


def round_to_bf16(x: Tensor, key: Tensor) -> Tensor:
    """fp32 `x` rounded to bf16 stochastically: up (away from zero) with probability its low 16 bits / 2^16, the
    bits from `hash32(element index x _GOLDEN + key)` on 32 bits; returned as the fp32 bit pattern of the chosen
    bf16 value."""
    index = torch.arange(x.numel(), dtype=torch.int32, device=x.device).view(x.shape)
    draw = hash32(index * _int32(_GOLDEN) + key.to(torch.int32)) & 0xFFFF
    bits = x.view(torch.int32)
    towards_zero = bits & -65536  # the upper 16 bits: bf16 rounded towards zero
    up = torch.where(draw < (bits & 0xFFFF), towards_zero + 0x10000, towards_zero)
    return up.view(torch.float32)


def bias_corrections(step: Tensor, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
    """Adam's bias corrections at `step`: 1 - beta1^step and sqrt(1 - beta2^step), fp32 like the step's math.
    Made once an optimizer step, not in every vector of the per-tensor loop (whose compiled code keeps libm's
    errno, so the compiler cannot hoist the powers out of it)."""
    return 1 - beta1**step, (1 - beta2**step).sqrt()


def adamw_bf16_step(
    p: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    correction1: Tensor,
    correction2_sqrt: Tensor,
    lr: Tensor,
    key: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> Tensor:
    """One AdamW update of bf16 `p` in fp32 (decoupled weight decay, moments bias-corrected by
    `bias_corrections`), written back to the bf16 moments and, stochastically rounded (`round_to_bf16`), to `p`;
    returns `p`."""
    p32 = p.float()
    g32 = grad.float()
    p32 = p32 - lr * weight_decay * p32
    m = exp_avg.float().lerp(g32, 1 - beta1)
    v = exp_avg_sq.float().lerp(g32.square(), 1 - beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    denom = v.sqrt() / correction2_sqrt + eps
    p32 = p32 - lr * (m / correction1) / denom
    return p.copy_(round_to_bf16(p32, key))


KERNELS = CompiledFunctions(
    {"adamw_bf16_step": adamw_bf16_step, "bias_corrections": bias_corrections}, "bf16 AdamW", devices=("cpu", "cuda")
)


def step_key(seed: int, step: int, index: int) -> int:
    """The hash key of tensor `index` at optimizer step `step` of a run seeded `seed` (63 bits)."""
    return (seed * 1_000_003 + step) * 65_537 + index & 0x7FFFFFFFFFFFFFFF


def flat_views(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors as 1-D aliases of their storage where all are contiguous (else as they are): one compiled graph
    then serves a 2-D weight and a 1-D norm alike (a second graph cost ~2.4 s of a fresh machine's first step, AMX
    Xeon), and the rounding's hash reads the same flat element index either way. Detached, so that dynamo sees no
    2-D view base to guard on (the version counter stays shared)."""
    if all(t.is_contiguous() for t in tensors):
        return tuple(t.view(-1).detach() for t in tensors)
    return tensors


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
        corrections: dict[tuple[float, float, float], tuple[Tensor, Tensor]] = {}  # by (step, beta1, beta2)
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
                step = state["step"]
                compiled = KERNELS.takes(p)
                made = (float(step), beta1, beta2)
                if made not in corrections:
                    both = KERNELS.run("bias_corrections", step, beta1, beta2) if compiled else None
                    corrections[made] = both if both is not None else bias_corrections(step, beta1, beta2)
                key = torch.tensor(step_key(self.seed, int(step), index), dtype=torch.int64)
                tensors = flat_views(p.detach(), p.grad, state["exp_avg"], state["exp_avg_sq"])
                args = (*tensors, *corrections[made], lr, key, beta1, beta2, group["eps"], group["weight_decay"])
                if not compiled or KERNELS.run("adamw_bf16_step", *args) is None:
                    adamw_bf16_step(*args)  # the same arithmetic, eagerly
        return loss
