"""Eager attention over grouped key/value heads (`engines/models/grouped_attention.py`): transformers' eager
attention's outputs, weights and gradients, with padding and over a prompt's KV cache; switched on only where
the model's attention is the Llama family's eager one with grouped heads; the trainer takes it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from rlstages.configs.training import OptimConfig, TorchTrainingConfig
from rlstages.engines.models.grouped_attention import NAME, use_grouped_eager
from rlstages.engines.training.core import PPOTrainer
from rlstages.engines.training.settings import TrainerSettings


def _llama(kv_heads: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=61, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=kv_heads, attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype).train()


def test_the_same_logits_weights_and_gradients_as_transformers_eager() -> None:
    """Six query heads over two key/value heads, left padding in the batch: the grouped model's logits, attention
    weights and parameter gradients are transformers' eager ones to fp32 rounding."""
    plain = _llama(kv_heads=2)
    grouped = copy.deepcopy(plain)
    assert use_grouped_eager(grouped) and grouped.config._attn_implementation == NAME
    ids = torch.randint(0, 61, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    outs = [m(input_ids=ids, attention_mask=mask, output_attentions=True) for m in (plain, grouped)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(outs[1].attentions, outs[0].attentions, strict=True):
        assert a.shape == b.shape == (3, 6, 10, 10)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for out in outs:
        out.logits[mask.bool()].square().sum().backward()
    for (name, a), b in zip(grouped.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_responses_over_a_prompt_cache_match() -> None:
    """A response's tokens over its prompt's KV cache (the shared-prompt forward: fewer queries than keys), in
    bf16: the grouped attention's logits are the eager ones to bf16 rounding."""
    from transformers import DynamicCache

    plain = _llama(kv_heads=3, dtype=torch.bfloat16)
    grouped = copy.deepcopy(plain)
    assert use_grouped_eager(grouped)
    gen = torch.Generator().manual_seed(2)
    prompt, response = torch.randint(0, 61, (2, 7), generator=gen), torch.randint(0, 61, (2, 4), generator=gen)
    logits = []
    with torch.no_grad():
        for model in (plain, grouped):
            cache = DynamicCache(config=model.config)
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
            logits.append(model(input_ids=response, past_key_values=cache, use_cache=True).logits.float())
    torch.testing.assert_close(logits[1], logits[0], rtol=2e-2, atol=2e-2)


def test_switched_only_for_grouped_heads_under_eager_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not switched: one key/value head per query head, sdpa attention, or an attention file whose eager
    function is not the Llama reference's (its own code kept)."""
    assert not use_grouped_eager(_llama(kv_heads=6))
    sdpa = _llama(kv_heads=2)
    sdpa.set_attn_implementation("sdpa")
    assert not use_grouped_eager(sdpa)
    import sys
    import types

    from transformers.models.llama.modeling_llama import LlamaAttention

    def softcapped(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):  # type: ignore[no-untyped-def]
        return torch.tanh(query), None

    modeling = types.ModuleType("softcapped_modeling")  # another model file: its own eager function
    modeling.eager_attention_forward = softcapped  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, modeling.__name__, modeling)
    own = type("SoftcappedAttention", (LlamaAttention,), {"__module__": modeling.__name__})
    other = _llama(kv_heads=2)
    for layer in other.model.layers:
        layer.self_attn.__class__ = own
    assert not use_grouped_eager(other) and other.config._attn_implementation == "eager"


def test_the_trainer_takes_it_unless_on_the_fp32_kernel(tiny_model_dir: Path) -> None:
    """The torch trainer with eager attention on the tiny Qwen2 (grouped heads) runs the grouped attention; on the
    fp32 kernel it keeps the fp32 kernel's own attention."""
    from rlstages.engines.training.fp32_matmul import FP32_ATTENTION

    def attention(fp32: bool) -> str:
        train = TorchTrainingConfig(optim=OptimConfig(lr=1e-3), attention="eager", fp32_matmul=fp32)
        trainer = PPOTrainer(TrainerSettings(str(tiny_model_dir), train=train, dtype="bfloat16"))
        return str(trainer.backend.model.config._attn_implementation)

    assert attention(False) == NAME
    assert attention(True) == FP32_ATTENTION["eager"]


def test_float_softmax_keeps_the_bf16_scores_and_is_autograds_softmax_bit_for_bit() -> None:
    """`FloatSoftmax` of bf16 scores with masked (-inf-like) entries: autograd's float32 softmax and its gradient
    bit for bit, half the bytes kept for the backward (the bf16 scores, not the float32 result)."""
    from rlstages.engines.models.grouped_attention import FloatSoftmax

    gen = torch.Generator().manual_seed(3)
    scores = (torch.randn(2, 3, 5, 9, generator=gen) * 4).to(torch.bfloat16)
    scores[0, :, :, :3] = torch.finfo(torch.bfloat16).min
    grad = torch.randn(2, 3, 5, 9, generator=gen)
    results = []
    for fn in (FloatSoftmax.apply, lambda s: torch.nn.functional.softmax(s, dim=-1, dtype=torch.float32)):
        leaf = scores.clone().requires_grad_(True)
        kept: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, kept=kept: kept.append(t.nbytes) or t, lambda t: t):
            out = fn(leaf)
        out.backward(grad)
        results.append((out.detach(), leaf.grad, sum(kept)))
    (got, got_grad, got_bytes), (want, want_grad, want_bytes) = results
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    assert got_bytes * 2 == want_bytes
