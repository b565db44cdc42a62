"""`engines/models/lean_layers.py`: the update's eager RMSNorm and SwiGLU keep less for the backward and compute what
transformers' Llama modules do: outputs bitwise, gradients to float32 rounding; a model routed on the CPU
(`fused_layers.fuse_elementwise`) trains through them and its forward keeps less."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlstages.engines.models import fused_layers, lean_layers


def _saved_bytes(fn) -> tuple[object, int]:
    """`fn()`'s result and the bytes of the distinct storages autograd kept for its backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _backward(out: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out.float() * w).sum().backward()
    return [t.grad.float() for t in leaves]


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_bitwise_and_its_gradients_match(dtype) -> None:
    """Against transformers' LlamaRMSNorm: the same output bit for bit, the same input and weight gradients (bf16:
    a bf16 rounding apart at most), and a third (bf16) or a half (float32) of the bytes kept for the backward."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 7, 64, generator=g) * 3).to(dtype)
    norm = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    (lx, lw), (rx, rw) = _leaves(x, norm.weight), _leaves(x, norm.weight)
    lean, lean_bytes = _saved_bytes(lambda: lean_layers.rms_norm(lx, lw, 1e-6))
    ref, ref_bytes = _saved_bytes(lambda: torch.func.functional_call(norm, {"weight": rw}, (rx,)))
    assert torch.equal(lean, ref)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    for a, b in zip(_backward(lean, [lx, lw]), _backward(ref, [rx, rw]), strict=True):
        torch.testing.assert_close(a, b, **tol)
        assert b.abs().max() > 1e-2
    weight_bytes = norm.weight.numel() * norm.weight.element_size()
    # kept beside the weight: bf16 keeps x, not its float32 copy and the cast; float32 keeps x, not x and h
    share = 0.4 if dtype == torch.bfloat16 else 0.6
    assert lean_bytes - weight_bytes < share * (ref_bytes - weight_bytes), (lean_bytes, ref_bytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_silu_times_up_and_keeps_two_of_three(dtype) -> None:
    """`silu(gate) * up`: the same output bit for bit, the same gradients, two tensors kept instead of three."""
    g = torch.Generator().manual_seed(0)
    gate, up = ((torch.randn(3, 7, 96, generator=g) * 2).to(dtype) for _ in range(2))
    (lg, lu), (rg, ru) = _leaves(gate, up), _leaves(gate, up)
    lean, lean_bytes = _saved_bytes(lambda: lean_layers.swiglu(lg, lu))
    ref, ref_bytes = _saved_bytes(lambda: torch.nn.functional.silu(rg) * ru)
    assert torch.equal(lean, ref)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    for a, b in zip(_backward(lean, [lg, lu]), _backward(ref, [rg, ru]), strict=True):
        torch.testing.assert_close(a, b, **tol)
    assert lean_bytes == 2 * gate.numel() * gate.element_size() and ref_bytes == 3 * lean_bytes // 2


def test_a_routed_model_on_the_cpu_trains_through_them(tiny_model_dir: Path, monkeypatch) -> None:
    """The tiny Qwen2 routed on the CPU (the compiled set off there): the same logits as the plain model, its
    parameters' gradients to float32 rounding, less kept for the backward; no-grad passes keep transformers' code."""
    from transformers import AutoModelForCausalLM

    assert not fused_layers.KERNELS.takes(torch.zeros(1))
    ids = torch.randint(3, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert fused_layers.fuse_elementwise(model)["rms_norm"] == 5
    (want, want_bytes), (got, got_bytes) = (_saved_bytes(lambda m=m: m(input_ids=ids).logits) for m in (plain, model))
    assert torch.equal(got, want)
    got.sum().backward()
    want.sum().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
    assert got_bytes < want_bytes
    calls: list[str] = []
    original = lean_layers.LeanRMSNorm.forward
    monkeypatch.setattr(
        lean_layers.LeanRMSNorm, "forward", staticmethod(lambda *a: calls.append("lean") or original(*a))
    )
    with torch.no_grad():
        model(input_ids=ids)
    assert calls == []
    model(input_ids=ids)
    assert len(calls) == 5


def _routed_llama_bf16() -> torch.nn.Module:
    """A tiny bf16 Llama (grouped heads) as the CPU trainer runs it: routed norms and SwiGLU, in-place gradient
    sums, the grouped eager attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlstages.engines.models.grouped_attention import use_grouped_eager
    from rlstages.engines.training.grad_accumulation import accumulate_in_place

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=61, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, attn_implementation="eager",
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16).train()
    assert fused_layers.fuse_elementwise(model)["swiglu"] == 2
    accumulate_in_place(model)
    assert use_grouped_eager(model)
    return model


def _train_pass(model: torch.nn.Module, scope: bool) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """Logits, parameter gradients and the bytes of the distinct storages autograd kept, with or without
    `remade_when_saved` (the kept bytes counted inside it: what the recipes replaced is not counted)."""
    ids = torch.randint(0, 61, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    model.zero_grad(set_to_none=True)
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> object:
        packed = lean_layers._pack(t) if scope else t
        if isinstance(packed, torch.Tensor):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, lean_layers._unpack):
        logits = model(input_ids=ids, attention_mask=mask).logits
    (logits.float().logsumexp(-1) * torch.linspace(0.5, 1.5, 12)).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()], sum(kept.values())


def test_outputs_remade_for_the_backward_give_the_same_gradients_bit_for_bit() -> None:
    """Under `remade_when_saved` the norms' and SwiGLU's outputs and the attention's bf16 weights and output are
    not kept but made again: the same logits and parameter gradients bit for bit, under 0.7x the bytes kept,
    and no recipe outlives the forward's tensors."""
    model = _routed_llama_bf16()
    want_logits, want_grads, want_bytes = _train_pass(model, scope=False)
    got_logits, got_grads, got_bytes = _train_pass(model, scope=True)
    assert torch.equal(got_logits, want_logits)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))
    assert got_bytes < 0.7 * want_bytes, (got_bytes, want_bytes)
    assert not lean_layers._made  # each recipe is forgotten with its output


def test_a_recipe_is_made_once_for_every_op_that_saved_it_and_views_are_kept_as_views() -> None:
    """q, k and v's projections save one normalised input: one remake serves the three; a view of a remembered
    output that an op saves comes back as the same view of the remade tensor."""
    calls: list[int] = []
    x = torch.randn(4, 6, requires_grad=True)
    with lean_layers.remade_when_saved():
        out = lean_layers.keep_recipe(x.detach() * 2, lambda: calls.append(1) or x.detach() * 2)
        w1, w2 = (torch.randn(6, 5, requires_grad=True) for _ in range(2))
        y = out @ w1 + out[:, 1:5] @ w2[:4]  # the second product saves a strided view of `out`
    assert calls == []
    y.sum().backward()
    assert calls == [1]
    doubled = x.detach() * 2
    torch.testing.assert_close(w1.grad, doubled.t() @ torch.ones(4, 5))
    torch.testing.assert_close(w2.grad[:4], doubled[:, 1:5].t() @ torch.ones(4, 5))
