"""The decode step's GEMMs on prepacked weights (engines/rollout/packed_gemm.py): bit-identical to `F.linear` at
every row count where oneDNN packs bf16, and a reason where it does not; the fast step on a bf16 model packs its
matrices, keeps no copies of the rest and decodes greedily what transformers' `generate` does. CPU only, seconds:
`pytest tests/engines/rollout/test_packed_gemm.py`."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.rollout.packed_gemm import linear, pack, packing_off
from rlstages.engines.types import Prompt, SamplingParams
from tests.engines.rollout.rollout_support import assert_greedy_as_generate

CPU = torch.device("cpu")
TEXTS = ("1+2=", "What is 10 + 12?", "7 plus 8 is")


def test_packed_linear_is_bit_identical_at_every_row_count_or_says_why_not() -> None:
    assert packing_off(torch.float32, CPU) == "torch.float32 weights (only bf16 is packed)"
    assert packing_off(torch.bfloat16, torch.device("meta")) == "meta device"
    reason = packing_off(torch.bfloat16, CPU, (96, 48))
    if reason is not None:  # a torch or CPU without oneDNN's bf16: the step multiplies plain weights, and says so
        assert "oneDNN" in reason or "differs" in reason
        return
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 48, generator=gen).to(torch.bfloat16)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    packed = pack(weight)
    assert packed.is_mkldnn and tuple(packed.shape) == (96, 48)
    for rows in (1, 3, 17, 64, 130):
        x = torch.randn(rows, 48, generator=gen).to(torch.bfloat16)
        assert torch.equal(linear(x, packed, bias), F.linear(x, weight, bias)), rows
        assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))  # a plain weight: F.linear itself


def test_fast_step_on_packed_bf16_weights_decodes_as_generate(tiny_model_dir: Path) -> None:
    engine = HFRolloutEngine(tiny_model_dir, dtype="bfloat16", apply_chat_template=False, fp32_weights=False)
    step = engine._fast_step(2, 64)
    assert step is not None and step.weights.pack  # a bf16 model on the CPU: packing asked for
    layers = len(engine.model.model.layers)
    reason = packing_off(torch.bfloat16, CPU)
    if reason is None:
        assert step.weights.packed == 4 * layers + 1  # qkv, o, gate/up, down per layer, and the head
        assert step.weights.plain_reason is None
    else:
        assert step.weights.packed == 0 and step.weights.plain_reason == reason
    assert not step.weights.views  # no copies: the model prefills on its own bf16 parameters
    assert step.weights.embed.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    prompts = [Prompt(f"u{i}", text, "0") for i, text in enumerate(TEXTS)]
    batch = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=10), seed=0)
    assert_greedy_as_generate(engine, TEXTS, batch)
