"""`engines/models/fused_layers.py`: the decoder's RMSNorm, SwiGLU and rotary embedding compiled for the update on
a GPU. Here the CPU stands in (inductor's C++ kernels, or aot_eager for the trainer-level check): the fused
functions give transformers' values and gradients, only Llama-code modules are routed, generation and no-grad
passes keep transformers' code, and a function that does not compile falls back to it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from rlstages.engines.models import fused_layers as FL


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The compiled path on the CPU with a fresh compile cache."""
    torch._dynamo.reset()
    monkeypatch.setattr(FL.KERNELS, "devices", ("cpu",))
    monkeypatch.setattr(FL.KERNELS, "compiled", {})
    monkeypatch.setattr(FL.KERNELS, "failed", set())
    monkeypatch.setattr(FL.KERNELS, "over_limit", set())
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    for modeling in (modeling_llama, modeling_qwen2):  # unrouted for this test, whatever routed them before
        fn = modeling.apply_rotary_pos_emb
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", getattr(fn, FL._ORIGINAL, fn))
    return FL


def _grads(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    w = torch.Generator().manual_seed(1)
    loss = sum((o.float() * torch.randn(o.shape, generator=w)).sum() for o in outs)
    loss.backward()
    return torch.cat([o.detach().float().flatten() for o in outs]), [t.grad.float() for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_functions_give_transformers_values_and_gradients(fused_on_cpu, dtype) -> None:
    """RMSNorm, SwiGLU and the rotary embedding compiled by inductor (C++ here, Triton on a GPU) against
    transformers' Llama modules, forward and backward, in float32 and bf16."""
    from transformers.models.llama import modeling_llama as m

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g).to(dtype)
    norm = m.LlamaRMSNorm(16, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16, generator=g) + 0.5)
    gate, up = (torch.randn(2, 5, 24, generator=g).to(dtype) for _ in range(2))
    q, k = torch.randn(2, 4, 5, 8, generator=g).to(dtype), torch.randn(2, 2, 5, 8, generator=g).to(dtype)
    angles = torch.rand(2, 5, 4, generator=g) * 6
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}

    cases = [
        (
            lambda x, w: FL.KERNELS.run("rms_norm", x, w, 1e-6),
            lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,)),
            (x, norm.weight),
        ),
        (lambda a, b: FL.KERNELS.run("swiglu", a, b), lambda a, b: torch.nn.functional.silu(a) * b, (gate, up)),
        (lambda *t: FL.KERNELS.run("rotary", *t), m.apply_rotary_pos_emb, (q, k, cos, sin)),
    ]
    for fused, reference, inputs in cases:
        got, got_grads = _grads(fused, *inputs)
        want, want_grads = _grads(reference, *inputs)
        torch.testing.assert_close(got, want, **tol)
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, **tol)
            assert b.abs().max() > 1e-3
    assert sorted(FL.KERNELS.compiled) == ["rms_norm", "rotary", "swiglu"] and not FL.KERNELS.failed


def test_llama_and_qwen_code_is_routed_and_other_code_is_not(fused_on_cpu, tiny_model_dir: Path) -> None:
    """The tiny Qwen2's 5 norms, 2 MLPs and 2 attentions are routed (twice: the same counts, nothing wrapped
    twice; a deep copy's modules run their own weights); a norm of other math (Gemma's 1 + weight) is not."""
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert FL.fuse_elementwise(model) == {"rms_norm": 5, "swiglu": 2, "rotary": 2}
    assert FL.fuse_elementwise(model) == {"rms_norm": 5, "swiglu": 2, "rotary": 2}
    twin = copy.deepcopy(model)  # a routed forward is bound to its module: a copy's is bound to the copy
    assert (
        twin.model.norm.forward.__self__ is twin.model.norm
        and twin.model.layers[0].mlp.forward.__self__ is not model.model.layers[0].mlp
    )
    gemma = torch.nn.Sequential(GemmaRMSNorm(8))
    assert FL.fuse_elementwise(gemma) == {"rms_norm": 0, "swiglu": 0, "rotary": 0}


def test_a_routed_llama_leaves_the_reference_intact(fused_on_cpu, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Routing a Llama replaces modeling_llama's rotary function, the reference the others are compared with: a
    Qwen2 routed after it still has its rotary routed (the reference is Llama's original code)."""
    from transformers import AutoModelForCausalLM

    from rlstages.engines.models import build_tiny_model

    llama = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "llama", model_type="llama"))
    assert FL.fuse_elementwise(llama) == {"rms_norm": 5, "swiglu": 2, "rotary": 2}
    qwen2 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert FL.fuse_elementwise(qwen2) == {"rms_norm": 5, "swiglu": 2, "rotary": 2}


def test_generation_and_no_grad_passes_keep_transformers_code(fused_on_cpu, tiny_model_dir: Path) -> None:
    """Routed, the model generates and scores under no_grad without compiling anything (decode steps keep
    transformers' kernels), and a training forward compiles the three functions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    FL.fuse_elementwise(model)
    ids = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False)
        model(input_ids=ids)
    assert FL.KERNELS.compiled == {}
    model(input_ids=ids).logits.sum().backward()
    assert sorted(FL.KERNELS.compiled) == ["rms_norm", "rotary", "swiglu"]


def test_a_function_that_does_not_compile_falls_back_to_transformers(
    fused_on_cpu, monkeypatch, tiny_model_dir: Path
) -> None:
    """A compiler that fails (no Triton, say): each function is marked failed once, and the routed model computes
    what the unrouted one does."""
    from transformers import AutoModelForCausalLM

    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(FL.KERNELS, "backend", broken)
    ids = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    want = plain(input_ids=ids).logits
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    FL.fuse_elementwise(model)
    got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want)
    assert sorted(FL.KERNELS.failed) == ["rms_norm", "rotary", "swiglu"]


def test_a_backward_that_does_not_compile_is_found_before_training(fused_on_cpu, monkeypatch, tiny_model_dir) -> None:
    """A compiler whose backward fails (it would raise inside `loss.backward()`, past `run`'s fallback): the probe
    the trainer runs first marks each function failed, and the routed model then trains as transformers."""
    from torch._dynamo.backends.common import aot_autograd
    from transformers import AutoModelForCausalLM

    def no_backward(gm, example_inputs):
        raise RuntimeError("no backward compiler here")

    monkeypatch.setattr(FL.KERNELS, "backend", aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=no_backward))
    assert FL.probe(torch.device("cpu"), torch.float32) == []
    assert sorted(FL.KERNELS.failed) == ["rms_norm", "rotary", "swiglu"]
    ids = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    plain(input_ids=ids).logits.sum().backward()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    FL.fuse_elementwise(model)
    model(input_ids=ids).logits.sum().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_the_probe_compiles_what_works(fused_on_cpu, monkeypatch) -> None:
    """With a working compiler the probe keeps all three functions."""
    monkeypatch.setattr(FL.KERNELS, "backend", "aot_eager")
    assert FL.probe(torch.device("cpu"), torch.bfloat16) == ["rms_norm", "swiglu", "rotary"] and not FL.KERNELS.failed


def test_the_rotary_function_behind_a_kernels_wrapper_is_the_one_compared() -> None:
    """transformers 5.25 with `kernels` installed makes `apply_rotary_pos_emb` an `nn.Module` wrapping the function,
    whose source cannot be read: the comparison reads the function it wraps (a plain function is itself)."""
    import inspect

    from transformers.models.llama import modeling_llama

    fn = modeling_llama.apply_rotary_pos_emb
    inner = FL.plain_function(getattr(fn, FL._ORIGINAL, fn))
    assert inspect.isfunction(inner) and inner.__name__ == "apply_rotary_pos_emb"
    assert "rotate_half(q)" in inspect.getsource(inner)
    assert FL.plain_function(FL.rotary) is FL.rotary
    assert FL.plain_function(torch.nn.Linear(2, 2)).__class__ is torch.nn.Linear  # a module without one: itself
