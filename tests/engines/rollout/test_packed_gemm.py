"""The decode step's GEMMs on prepacked weights (engines/rollout/packed_gemm.py): bit-identical to `F.linear` at
every row count where oneDNN packs bf16, and a reason where it does not; the fast step on a bf16 model packs its
matrices, keeps no copies of the rest and decodes greedily what transformers' `generate` does; an fp32 copy of a
bf16 model is packed within fp32 rounding of `F.linear` and prefills a layer at a time. CPU only, seconds:
`pytest tests/engines/rollout/test_packed_gemm.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlstages.engines.models import load_causal_lm
from rlstages.engines.rollout import packed_gemm
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.rollout.packed_gemm import linear, pack, packing_off
from rlstages.engines.types import Prompt, SamplingParams
from tests.engines.rollout.rollout_support import assert_greedy_as_generate

CPU = torch.device("cpu")
TEXTS = ("1+2=", "What is 10 + 12?", "7 plus 8 is")


def test_packed_linear_is_bit_identical_at_every_row_count_or_says_why_not() -> None:
    own_fp32 = "the model's own float32 weights (bf16 and a widened fp32 copy are packed)"
    assert packing_off(torch.float32, CPU) == own_fp32
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


def _spy_on_blocks(monkeypatch: pytest.MonkeyPatch, block: int) -> list[int]:
    """Small blocks for a small weight, a fresh per-shape check, and a list that grows at each blocked product."""
    calls: list[int] = []
    real = packed_gemm.blocked_linear

    def spy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(packed_gemm, "WIDE_BLOCK", block)
    monkeypatch.setattr(packed_gemm, "_blocks_match", {})
    monkeypatch.setattr(packed_gemm, "blocked_linear", spy)
    return calls


def test_a_wide_fp32_product_runs_in_blocks_only_where_their_sums_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(100, 48, generator=gen), torch.randn(100, generator=gen)
    x = [torch.randn(rows, 48, generator=gen) for rows in (1, 3, 17, 64)]
    blocked = packed_gemm.blocked_linear
    calls = _spy_on_blocks(monkeypatch, 16)
    for rows in x:  # the blocks' values, whatever this CPU's MKL does at each width
        torch.testing.assert_close(blocked(rows, weight, bias), F.linear(rows, weight, bias))
    same = torch.equal(blocked(x[3], weight, bias), F.linear(x[3], weight, bias))  # MKL may sum narrow blocks apart
    assert torch.equal(linear(x[3], weight, bias), F.linear(x[3], weight, bias))  # first call: the plain result
    assert packed_gemm._blocks_match == {(100, 48): same}
    for rows in x:
        assert torch.equal(linear(rows, weight, bias), F.linear(rows, weight, bias))
    assert calls == [64] + ([1, 3, 17, 64] if same else [])  # the check, then blocks only where they matched
    calls.clear()
    linear(x[0], weight[:63])  # narrower than four blocks: one plain product
    assert calls == []

    for exact in (True, False):  # blocks that give F.linear's sums are taken from then on; others never
        monkeypatch.setattr(packed_gemm, "_blocks_match", {})
        shift = 0.0 if exact else 1.0
        taken: list[int] = []
        fake = lambda x, w, b=None, taken=taken, shift=shift: taken.append(len(x)) or F.linear(x, w, b) + shift  # noqa: E731
        monkeypatch.setattr(packed_gemm, "blocked_linear", fake)
        assert torch.equal(linear(x[1], weight), F.linear(x[1], weight))
        assert packed_gemm._blocks_match == {(100, 48): exact}
        assert torch.equal(linear(x[2], weight), F.linear(x[2], weight))
        assert taken == ([3, 17] if exact else [3])


def test_fast_step_with_a_blocked_fp32_head_decodes_as_generate(tiny_model_dir: Path, monkeypatch) -> None:
    engine = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    vocab = engine.model.lm_head.weight.shape[0]
    calls = _spy_on_blocks(monkeypatch, vocab // 8)
    prompts = [Prompt(f"u{i}", text, "0") for i, text in enumerate(TEXTS)]
    batch = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=10), seed=0)
    assert_greedy_as_generate(engine, TEXTS, batch)
    assert calls and (vocab, engine.model.config.hidden_size) in packed_gemm._blocks_match  # the head was checked


def test_a_packed_fp32_copy_is_within_fp32_rounding_of_f_linear() -> None:
    reason = packing_off(torch.float32, CPU, (96, 48), widened=True)
    if reason is not None:  # a torch without oneDNN: the widened copy stays plain, and says so
        assert "oneDNN" in reason or "rounding" in reason
        return
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(96, 48, generator=gen), torch.randn(96, generator=gen)
    packed = pack(weight)
    assert packed.is_mkldnn and packed.dtype == torch.float32
    for rows in (1, 3, 17, 64, 130):
        x = torch.randn(rows, 48, generator=gen)
        plain = F.linear(x, weight, bias)
        assert (linear(x, packed, bias) - plain).abs().max() <= packed_gemm.FP32_RTOL * plain.abs().max(), rows


def test_a_widened_copy_is_packed_and_its_prefill_widens_one_module_at_a_time(tiny_model_dir: Path) -> None:
    """A bf16 model on its fp32 copy: the matrices and head only packed (no plain copies, the embedding the
    model's own), each layer widened while it prefills and bf16 again after, also when a layer raises; the
    embedding looks its rows up in bf16 and the packed head stands in for the model's (neither widened whole),
    the logits those of the fp32 model."""
    engine = HFRolloutEngine(tiny_model_dir, dtype="bfloat16", apply_chat_template=False, fp32_weights=True)
    step = engine._fast_step(2, 64)
    assert step is not None
    weights, layers = step.weights, engine.model.model.layers
    if packing_off(torch.float32, CPU, widened=True) is not None:
        assert not weights.widened and weights.plain_reason == packing_off(torch.float32, CPU, widened=True)
        return
    assert weights.widened and weights.packed == 4 * len(layers) + 1
    assert not any(name.endswith("proj.weight") for name in weights.views)  # the matrices are not kept plain
    embedding = engine.model.model.embed_tokens.weight
    assert "model.embed_tokens.weight" not in weights.views and weights.embed.data_ptr() == embedding.data_ptr()
    seen: list[set[torch.dtype]] = []
    attention = layers[1].self_attn  # runs inside its layer: it sees what the layer has while running
    probe = attention.register_forward_pre_hook(lambda m, a: seen.append({p.dtype for p in m.parameters()}))
    looked_up: list[torch.dtype] = []
    lookup = engine.model.model.embed_tokens.register_forward_pre_hook(lambda m, a: looked_up.append(m.weight.dtype))
    head = engine.model.lm_head
    ids = torch.tensor([engine.tokenizer(TEXTS[1])["input_ids"]])
    with weights.swapped(engine.model), torch.no_grad():
        logits = engine.model(input_ids=ids).logits
        matrices = [p for name, p in layers[0].named_parameters() if name.endswith("proj.weight")]
        assert {p.dtype for p in matrices} == {torch.bfloat16}  # widened while it ran, then put back
        assert engine.model.lm_head is not head and engine.model.lm_head.packed is weights.head
    probe.remove(), lookup.remove()
    assert seen == [{torch.float32}] and looked_up == [torch.bfloat16] and engine.model.lm_head is head
    with torch.no_grad():
        wide = load_causal_lm(tiny_model_dir, "bfloat16").float()(input_ids=ids).logits
    assert logits.dtype == torch.float32 and (logits - wide).abs().max() < 1e-4 * wide.abs().max()

    def fail(module: torch.nn.Module, args: object, output: object) -> None:
        raise RuntimeError("a layer failed")

    failing = layers[0].register_forward_hook(fail, prepend=True)
    with pytest.raises(RuntimeError, match="a layer failed"), weights.swapped(engine.model):
        engine.model(input_ids=ids)
    failing.remove()
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert embedding.dtype == torch.bfloat16 and engine.model.lm_head is head
