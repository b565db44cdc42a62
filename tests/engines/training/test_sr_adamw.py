"""`engines/training/sr_adamw.py`: the stochastic rounding to bf16 (always one of the two neighbours, unbiased,
the same bits for the same key and others for another), and the compiled AdamW step equal to the eager one bit for
bit (the eager one is the fallback where nothing compiles)."""

from __future__ import annotations

import pytest
import torch

from rlstages.engines.training.sr_adamw import (
    KERNELS,
    BF16StochasticAdamW,
    adamw_bf16_step,
    bias_corrections,
    hash32,
    round_to_bf16,
    step_key,
)


def lowbias32(x: int) -> int:
    """Wellons' lowbias32 on Python ints: the reference the int32-lane `hash32` must equal."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_int32_hash_is_lowbias32() -> None:
    values = [0, 1, 2, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 0x9E3779B1, 123456789, 3141592653]
    lanes = torch.tensor([v - 2**32 if v >= 2**31 else v for v in values], dtype=torch.int32)
    got = [v & 0xFFFFFFFF for v in hash32(lanes).tolist()]
    assert got == [lowbias32(v) for v in values]


def test_rounding_picks_a_neighbour_unbiased_and_is_keyed() -> None:
    value = 1.0 + 3 * 2**-10  # 3/8 of the way from 1.0 to its bf16 neighbour above, 1.0 + 2^-7
    x = torch.full((200_000,), value, dtype=torch.float32)
    x[::2] *= -1  # negative values round towards / away from zero alike
    rounded = round_to_bf16(x.clone(), torch.tensor(7))
    magnitude = rounded.abs()
    assert ((magnitude == 1.0) | (magnitude == 1.0 + 2**-7)).all() and torch.equal(rounded.sign(), x.sign())
    assert rounded[1::2].mean().item() == pytest.approx(value, abs=2e-4)  # unbiased: the mean is x
    assert rounded[::2].mean().item() == pytest.approx(-value, abs=2e-4)
    assert torch.equal(round_to_bf16(x.clone(), torch.tensor(7)), rounded)  # the same key: the same bits
    other = round_to_bf16(x.clone(), torch.tensor(8))
    assert 0.4 < (other != rounded).float().mean().item() < 0.6  # another key: independent draws (p 3/8 each)


def test_the_compiled_step_equals_the_eager_one() -> None:
    torch.manual_seed(0)
    p = torch.randn(64, 48).to(torch.bfloat16)
    grad = (torch.randn(64, 48) * 1e-3).to(torch.bfloat16)
    eager, compiled = [(p.clone(), grad, torch.zeros_like(p), torch.zeros_like(p)) for _ in range(2)]
    corrections = bias_corrections(torch.tensor(3.0), 0.9, 0.999)
    compiled_corrections = KERNELS.run("bias_corrections", torch.tensor(3.0), 0.9, 0.999)
    assert compiled_corrections is not None and all(map(torch.equal, corrections, compiled_corrections))
    rest = (*corrections, torch.tensor(1e-3), torch.tensor(12345), 0.9, 0.999, 1e-8, 0.01)
    adamw_bf16_step(*eager, *rest)
    assert KERNELS.run("adamw_bf16_step", *compiled, *rest) is not None  # it compiled (None: the eager fallback)
    (w0, _, m0, v0), (w1, _, m1, v1) = eager, compiled
    assert torch.equal(w0, w1) and torch.equal(m0, m1) and torch.equal(v0, v1)
    assert not torch.equal(w0, p)  # it moved


def test_the_optimizer_is_deterministic_by_seed() -> None:
    def run(seed: int) -> torch.Tensor:
        w = torch.nn.Parameter(torch.ones(128, 128, dtype=torch.bfloat16))
        opt = BF16StochasticAdamW([w], lr=1e-4, seed=seed)
        for _ in range(3):
            w.grad = torch.ones_like(w)
            opt.step()
        return w.detach().clone()

    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))


def test_one_compiled_graph_serves_weights_and_norms_with_the_per_shape_bits(monkeypatch) -> None:
    """Contiguous parameters go into the compiled step flat: a 2-D weight and a 1-D norm share one graph (each rank
    was a compilation of its own), and the new weights are bit for bit those of the eager step on their own shapes
    (the rounding's hash reads the flat element index either way)."""
    graphs: list[object] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(KERNELS, "backend", counting)
    monkeypatch.setattr(KERNELS, "compiled", {})
    torch.manual_seed(0)
    shapes = ((48, 40), (40,))
    params = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in shapes]
    grads = [(torch.randn(s) * 1e-3).to(torch.bfloat16) for s in shapes]
    expected = [p.detach().clone() for p in params]
    opt = BF16StochasticAdamW(params, lr=1e-3, weight_decay=0.01, seed=7)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()
    assert len([g for g in graphs if "copy_" in str(g.code)]) == 1  # the AdamW step's graph (besides the corrections')
    corrections = bias_corrections(torch.tensor(1.0), 0.9, 0.999)
    for index, (w, g) in enumerate(zip(expected, grads, strict=True), start=1):
        key = torch.tensor(step_key(7, 1, index), dtype=torch.int64)
        rest = (*corrections, torch.tensor(1e-3), key, 0.9, 0.999, 1e-8, 0.01)
        adamw_bf16_step(w, g, torch.zeros_like(w), torch.zeros_like(w), *rest)
    for p, w in zip(params, expected, strict=True):
        assert p.shape == w.shape and torch.equal(p.detach(), w)
