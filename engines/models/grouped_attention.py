"""Eager attention over grouped key/value heads without repeating them: the trained model's eager attention.

transformers' eager attention repeats each key/value head for every query head of its group (`repeat_kv`: an
expand and a copy of K and of V per layer, kept for the backward, whose gradient is then summed back over the
group). Here the queries of a group are stacked instead, [B, kv_heads, group x T, D], so each score and output
GEMM reads the one K or V head as it is; the mask broadcasts over the group. The same dot products and
softmax: the demo's logits came out bitwise equal on an AMX Xeon, and forward + backward of five demo-sized
micro-batches took 3.52 s against 3.66 (2 threads, best of 4, under the workers' jemalloc).

Non-goal: attention functions other than the Llama family's eager one (softcapping, sinks, sliding windows keep
their own), sdpa and flash attention (which group heads themselves).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import Tensor

from rlstages.engines.models.lean_layers import keep_recipe

log = logging.getLogger(__name__)

NAME = "rlstages_grouped_eager"


def grouped_eager_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """The Llama family's `eager_attention_forward` with each key/value head read once by its group's queries;
    returns the output [B, T, heads, D] and the attention weights [B, heads, T, S], as it does."""
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    stacked = query.reshape(batch, kv_heads, group * length, dim)
    weights = (torch.matmul(stacked, key.transpose(2, 3)) * scaling).view(batch, kv_heads, group, length, keys)
    if attention_mask is not None:  # [B, 1, T, S] over every head, or a mask per head
        per_head = attention_mask.shape[1] != 1
        mask = attention_mask.view(batch, kv_heads, group, length, -1) if per_head else attention_mask.unsqueeze(2)
        weights = weights + mask
    scores = weights
    weights = FloatSoftmax.apply(scores).to(query.dtype)
    shape = (batch, heads, length, dim)
    if torch.is_grad_enabled() and not (dropout and module.training):
        # what the backward keeps besides the scores (`FloatSoftmax`) and the values: neither the bf16 weights nor
        # the output (the output projection's input); both are made again from the scores (a softmax, a product)
        keep_recipe(weights, lambda: _weights(scores, query.dtype))
        out = keep_recipe(_output(weights, value, shape), lambda: _output(_weights(scores, query.dtype), value, shape))
        return out, weights.view(batch, heads, length, keys)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return _output(weights, value, shape), weights.view(batch, heads, length, keys)


def _softmax32(scores: Tensor) -> Tensor:
    """The float32 softmax over the last dim of the masked, scaled scores (the Llama family's eager attention's)."""
    return torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32)


def _weights(scores: Tensor, dtype: torch.dtype) -> Tensor:
    """The attention weights in `dtype` from the masked, scaled scores: the float32 softmax, cast."""
    return _softmax32(scores).to(dtype)


class FloatSoftmax(torch.autograd.Function):
    """`softmax(scores, -1, dtype=float32)` that keeps the scores (bf16: half the bytes of the float32 result that
    autograd's softmax keeps) and makes the result again for its backward: the same values and gradient."""

    @staticmethod
    def forward(ctx: Any, scores: Tensor) -> Tensor:
        """The float32 softmax over the last dim; keeps `scores`."""
        ctx.save_for_backward(scores)
        return _softmax32(scores)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        """Autograd's softmax backward (its kernel) on the remade result, cast back to the scores' dtype."""
        (scores,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, _softmax32(scores), -1, torch.float32).to(scores.dtype)


def _output(weights: Tensor, value: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
    """The attention's output [B, T, heads, D] from its (grouped) weights and values."""
    batch, heads, length, dim = shape
    kv_heads, keys = value.shape[1], value.shape[2]
    out = torch.matmul(weights.view(batch, kv_heads, -1, keys), value)
    return out.view(batch, heads, length, dim).transpose(1, 2).contiguous()


def use_grouped_eager(model: torch.nn.Module) -> bool:
    """Switch a transformers model from eager attention to `grouped_eager_attention`, in place, where every
    attention module of it groups its key/value heads and calls its file's eager function, whose code is the
    Llama reference's; whether it was switched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.models.llama import modeling_llama

    from rlstages.engines.models.fused_layers import _body, _same_code

    config = getattr(model, "config", None)
    switch = getattr(model, "set_attn_implementation", None)
    if getattr(config, "_attn_implementation", None) != "eager" or not callable(switch):
        return False
    attentions = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "q_proj")]
    reference = _body(modeling_llama.eager_attention_forward)
    for module in attentions:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if getattr(module, "num_key_value_groups", 1) <= 1 or not _same_code(eager, reference):
            return False
    if not attentions:
        return False
    AttentionInterface.register(NAME, grouped_eager_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])  # the eager masks, as they are
    switch(NAME)
    log.info("eager attention over grouped key/value heads: %d layers", len(attentions))
    return True
