"""The bf16 stochastic-rounding AdamW step (`engines/training/sr_adamw.py`, the demo's optimizer) on the demo
model's parameter shapes (SmolLM2-135M: 134.5M parameters, the embedding tied), against torch's fused fp32 AdamW
step on the same shapes in the same run (the baseline: what an AdamW step costs on this machine); torchao's
`_AdamW` with `bf16_stochastic_round` too where it is installed (it was the optimizer before; no longer a
dependency). Median of 3 steps after the compiling one, the process's torch threads.
`python -m bench.bench_sr_adamw`"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from bench.common import best_of, record, report
from rlstages.engines.training.sr_adamw import BF16StochasticAdamW

HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30  # SmolLM2-135M
LAYER = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN),
         (HIDDEN, INTER), (HIDDEN,), (HIDDEN,)]  # fmt: skip
SHAPES = [(VOCAB, HIDDEN), *LAYER * LAYERS, (HIDDEN,)]


def parameters(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """The shapes' parameters in `dtype`, each with a small gradient."""
    g = torch.Generator().manual_seed(0)
    out = []
    for shape in SHAPES:
        p = torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))
        p.grad = (torch.randn(shape, generator=g) * 1e-3).to(dtype)
        out.append(p)
    return out


def step_seconds(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], dtype: torch.dtype) -> float:
    """Median seconds of an optimizer step after the first (`best_of`'s warm-up: it compiles)."""
    return best_of(make(parameters(dtype)).step, repeat=3)


def main() -> None:
    """Record ours (and torchao's where installed) against torch's fused fp32 AdamW."""
    n = sum(torch.Size(s).numel() for s in SHAPES)
    base = step_seconds(lambda ps: torch.optim.AdamW(ps, lr=1e-5, fused=True), torch.float32)
    ours = step_seconds(lambda ps: BF16StochasticAdamW(ps, lr=1e-5), torch.bfloat16)
    rows = [("bf16 SR AdamW (ours)", ours, base, "-")]
    detail = f"{ours:.3f} s a step for {n / 1e6:.1f}M parameters, fused fp32 AdamW {base:.3f} s"
    record("bf16_sr_adamw_step_vs_fused_fp32_adamw", ours / base, None, detail)
    if importlib.util.find_spec("torchao") is not None:
        from torchao.optim import _AdamW

        theirs = step_seconds(lambda ps: _AdamW(ps, lr=1e-5, bf16_stochastic_round=True), torch.bfloat16)
        rows.append(("torchao _AdamW, bf16_stochastic_round", theirs, base, "-"))
        record("torchao_sr_adamw_step_vs_fused_fp32_adamw", theirs / base, None, f"{theirs:.3f} s a step")
    report("one AdamW step on SmolLM2-135M's shapes (ratio = optimizer / fused fp32 AdamW)", rows)


if __name__ == "__main__":
    main()
