"""Weight gradients summed in place over micro-batches (`actor.gradient_accumulation_fusion`): the gradients
autograd sums, for tied and untied embeddings, biases, the padding row and the fp32 kernel's layers; the
trainer swaps the layers as configured and not under LoRA."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from rlstages.configs.model import LoraSettings
from rlstages.configs.training import OptimConfig, TorchTrainingConfig
from rlstages.engines.training.core import PPOTrainer
from rlstages.engines.training.fp32_matmul import Fp32KernelLinear, use_fp32_kernel
from rlstages.engines.training.grad_accumulation import (
    InPlaceGradEmbedding,
    InPlaceGradLinear,
    accumulate_in_place,
)
from rlstages.engines.training.settings import TrainerSettings

# at collection, not inside a test: pytest's assertion rewriter parses a test module when it is first imported, and
# CPython 3.11.7's ast.parse mid-run failed once in CI with "AST constructor recursion depth mismatch" (gh-106905)
from tests.engines.training.test_fp32_matmul import _graded_batch


def _model(arch: str, tied: bool, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    if arch == "qwen2":  # q/k/v with biases
        return Qwen2ForCausalLM(Qwen2Config(**shape, num_key_value_heads=2, tie_word_embeddings=tied)).to(dtype)
    config = LlamaConfig(**shape, num_key_value_heads=2, tie_word_embeddings=tied, pad_token_id=3)
    return LlamaForCausalLM(config).to(dtype)


def _grads_over_micro_batches(model: torch.nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("llama", False), ("qwen2", True)])
def test_the_same_gradients_as_autograd_over_micro_batches(arch: str, tied: bool) -> None:
    """Three micro-batches (the padding token among the ids) backpropagated into in-place layers sum the
    gradients autograd sums, for every parameter, to fp32 rounding; the tied head stays the embedding."""
    native = _model(arch, tied, torch.float32)
    fused = copy.deepcopy(native)
    counts = accumulate_in_place(fused)
    assert counts == {"linear": 2 * 7 + 1, "embedding": 1}  # the head is a layer of its own, tied or not
    assert (fused.lm_head.weight is fused.model.embed_tokens.weight) == tied
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 97, (3, 9), generator=gen) for _ in range(3)]
    batches[0][:, :2] = 3  # left padding, the padding token of the Llama config
    want, got = _grads_over_micro_batches(native, batches), _grads_over_micro_batches(fused, batches)
    assert want.keys() == got.keys() and len(want) == len(list(native.parameters()))
    for name, grad in want.items():
        assert torch.allclose(got[name], grad, rtol=1e-5, atol=1e-6), name
    if arch == "llama" and not tied:  # the padding row takes no gradient from the lookup
        assert got["model.embed_tokens.weight"][3].abs().max() == 0


def test_bf16_sums_stay_within_bf16_rounding_of_an_fp32_reference() -> None:
    """In bf16 the in-place sum (one rounding per GEMM) is as close to the fp32 model's gradients as autograd's
    (a rounding per micro-batch and one per sum), within bf16's resolution."""
    reference = _model("llama", True, torch.float32)
    native = copy.deepcopy(reference).to(torch.bfloat16)
    fused = copy.deepcopy(native)
    accumulate_in_place(fused)
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 97, (4, 12), generator=gen) for _ in range(4)]
    ref = _grads_over_micro_batches(copy.deepcopy(native).float(), batches)  # the bf16 weights, in fp32 math
    errors = {}
    for label, model in (("autograd", native), ("in place", fused)):
        grads = _grads_over_micro_batches(model, batches)
        errors[label] = max(float((grads[n] - g).norm() / g.norm()) for n, g in ref.items())
    assert errors["in place"] < 0.02 and errors["in place"] <= errors["autograd"] * 1.5, errors


def test_fp32_kernel_layers_add_their_blocks_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 layer on the fp32 kernel with `grad_in_place` adds each block of output features into `.grad`
    (blocks smaller than the layer here) and gives the gradient its sum over two micro-batches."""
    from rlstages.engines.training import fp32_matmul

    monkeypatch.setattr(fp32_matmul, "BLOCK", 32)
    torch.manual_seed(0)
    native = torch.nn.Linear(48, 80).to(torch.bfloat16)
    fused = copy.deepcopy(native)
    use_fp32_kernel(fused)
    assert accumulate_in_place(fused) == {"linear": 1, "embedding": 0} and type(fused) is Fp32KernelLinear
    xs = [torch.randn(5, 48).bfloat16() for _ in range(2)]
    for layer in (native, fused):
        for x in xs:
            layer(x).float().square().sum().backward()
    exact = sum(2 * (x.float() @ native.weight.float().t() + native.bias.float()).t() @ x.float() for x in xs)
    assert isinstance(exact, torch.Tensor)
    scale = exact.abs().max()
    assert (fused.weight.grad.float() - exact).abs().max() < 0.02 * scale
    assert torch.allclose(fused.bias.grad.float(), native.bias.grad.float(), rtol=0.02, atol=0.02)


def test_no_grad_and_other_dtypes_take_the_layers_own_path() -> None:
    """Outside autograd, and where autocast computes in another dtype than the weights', the layers return
    exactly what `nn.Linear` / `nn.Embedding` return (and fp32 weights under bf16 autocast get fp32 gradients)."""
    torch.manual_seed(0)
    native, embed = torch.nn.Linear(16, 8), torch.nn.Embedding(10, 16)
    fused, fused_embed = copy.deepcopy(native), copy.deepcopy(embed)
    fused.__class__, fused_embed.__class__ = InPlaceGradLinear, InPlaceGradEmbedding
    x, ids = torch.randn(4, 16), torch.tensor([1, 2, 2, 9])
    with torch.no_grad():
        assert torch.equal(fused(x), native(x)) and torch.equal(fused_embed(ids), embed(ids))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, want = fused(x), native(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    out.float().sum().backward()
    assert fused.weight.grad is not None and fused.weight.grad.dtype == torch.float32


def test_the_trainer_sums_in_place_as_configured_and_not_under_lora(tiny_model_dir: Path) -> None:
    """The torch trainer swaps its layers by default, keeps them plain with the option off or under LoRA, and
    one train step's loss and gradient norm match the plain trainer's."""

    batch = _graded_batch(tiny_model_dir)

    def trainer(fused: bool, lora: bool = False) -> PPOTrainer:
        train = TorchTrainingConfig(optim=OptimConfig(lr=1e-3), micro_batch_size=4, gradient_accumulation_fusion=fused)
        adapters = LoraSettings(rank=4, alpha=8.0).model_dump(mode="json") if lora else None
        return PPOTrainer(TrainerSettings(str(tiny_model_dir), train=train, dtype="float32", lora=adapters))

    plain, fused, adapted = trainer(False), trainer(True), trainer(True, lora=True)
    kinds = [{type(m) for m in t.backend.model.modules()} for t in (plain, fused, adapted)]
    assert InPlaceGradLinear in kinds[1] and InPlaceGradEmbedding in kinds[1]
    assert not ({InPlaceGradLinear, InPlaceGradEmbedding} & (kinds[0] | kinds[2]))
    assert [k for k, _ in plain.named_weights()] == [k for k, _ in fused.named_weights()]
    m = [t.train_step(batch) for t in (plain, fused)]
    assert m[1]["pg_loss"] == pytest.approx(m[0]["pg_loss"], rel=1e-4, abs=1e-6)
    assert m[1]["grad_norm"] == pytest.approx(m[0]["grad_norm"], rel=1e-4)


def test_gradients_land_on_the_parameters_under_saved_tensor_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward under `saved_tensors_hooks` (a memory probe's, the profiler's) still sums into the parameters'
    own `.grad`, on the native layers and on the fp32 kernel's: the backward does not write into an unpacked copy."""
    from rlstages.engines.training import fp32_matmul

    monkeypatch.setattr(fp32_matmul, "BLOCK", 32)
    torch.manual_seed(0)
    plain, upcast = torch.nn.Linear(24, 40), torch.nn.Linear(24, 40).to(torch.bfloat16)
    use_fp32_kernel(upcast)
    for layer in (plain, upcast):
        accumulate_in_place(layer)
        x = torch.randn(3, 24).to(layer.weight.dtype)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = layer(x)
        out.float().sum().backward()
        assert layer.weight.grad is not None and layer.weight.grad.abs().max() > 0


def test_gradient_checkpointing_sums_the_same_gradient(tiny_model_dir: Path) -> None:
    """With activation checkpointing (its recomputation runs under saved-tensor hooks) one train step's gradient
    norm is the one without it: every layer's sum reaches its parameter."""

    batch = _graded_batch(tiny_model_dir)
    norms = []
    for checkpointing in (False, True):
        train = TorchTrainingConfig(
            optim=OptimConfig(lr=1e-3), micro_batch_size=4, gradient_checkpointing=checkpointing
        )
        trainer = PPOTrainer(TrainerSettings(str(tiny_model_dir), train=train, dtype="float32"))
        norms.append(trainer.train_step(batch)["grad_norm"])
    assert norms[1] == pytest.approx(norms[0], rel=1e-5) and norms[0] > 0
