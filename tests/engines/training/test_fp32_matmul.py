"""bf16 linear layers on the fp32 GEMM (`actor.fp32_matmul`): the same values and gradients as the bf16 kernel
to bf16's resolution, closer to an fp32 reference than bf16 rounding, and chosen by the trainer as configured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlstages.configs.model import LoraSettings
from rlstages.configs.training import OptimConfig, TorchTrainingConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.training import fp32_matmul
from rlstages.engines.training.core import PPOTrainer
from rlstages.engines.training.fp32_matmul import Fp32KernelLinear, cpu_has_amx, use_fp32_kernel, wants_fp32_kernel
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams


def _pair(
    bias: bool, dtype: torch.dtype, features: tuple[int, int] = (96, 80)
) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(0)
    native = torch.nn.Linear(*features, bias=bias).to(dtype)
    upcast = torch.nn.Linear(*features, bias=bias).to(dtype)
    upcast.load_state_dict(native.state_dict())
    assert use_fp32_kernel(upcast) == 1 and isinstance(upcast, Fp32KernelLinear)
    return native, upcast


def _bf16_kernel(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """nn.Linear's own computation, written out: one bf16 GEMM (addmm), so a library that patches F.linear
    process-wide (DeepSpeed ZeRO-3, from another test) does not change the reference."""
    x2 = x.reshape(-1, x.shape[-1])
    y = x2 @ layer.weight.t() if layer.bias is None else torch.addmm(layer.bias, x2, layer.weight.t())
    return y.reshape(*x.shape[:-1], -1)


def test_kept_buffers_give_what_fresh_tensors_give() -> None:
    """The fp32 upcasts and block products go through this thread's kept buffers (not a fresh multi-MB tensor
    a call, page-faulted anew under jemalloc): two layers of different widths, one after the other, give the
    values of the same GEMMs on fresh tensors bit for bit and their gradients to bf16's resolution, and the
    buffers are reused."""
    torch.manual_seed(0)
    wide, narrow = torch.nn.Linear(48, 160).to(torch.bfloat16), torch.nn.Linear(160, 64).to(torch.bfloat16)
    for layer in (wide, narrow):
        use_fp32_kernel(layer)
    x = torch.randn(5, 48).bfloat16().requires_grad_(True)

    def fresh(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:  # the same products, fresh operands
        return (torch.mm(x.float(), layer.weight.float().t()) + layer.bias.float()).bfloat16()

    ys = [narrow(wide(x)), fresh(fresh(x, wide), narrow)]
    assert torch.equal(ys[0], ys[1])
    kept = fp32_matmul._SCRATCH.w
    grads = []
    for y in ys:
        grads.append(torch.autograd.grad(y.float().square().sum(), [x, wide.weight, narrow.weight]))
    for mine, reference in zip(*grads, strict=True):
        assert torch.allclose(mine.float(), reference.float(), rtol=2**-7, atol=1e-3)
    assert fp32_matmul._SCRATCH.w is kept and kept.numel() >= 64 * 160  # grown to the largest weight, then reused


@pytest.mark.parametrize(("bias", "block"), [(False, 4096), (True, 4096), (True, 32)])
def test_same_values_and_gradients_as_the_bf16_kernel(bias: bool, block: int, monkeypatch) -> None:
    """Also block by block of output features (80 features in blocks of 32: the last block partial)."""
    monkeypatch.setattr(fp32_matmul, "BLOCK", block)
    native, upcast = _pair(bias, torch.bfloat16)
    x = torch.randn(3, 7, 96).bfloat16()
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [_bf16_kernel(xs[0], native), upcast(xs[1])]
    assert ys[1].dtype == torch.bfloat16
    exact = x.double() @ native.weight.double().t() + (native.bias.double() if bias else 0.0)
    for y in ys:  # both within bf16 rounding of the exact product (one ulp: 2^-8 relative)
        assert ((y.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    g = torch.randn_like(ys[0])
    for y in ys:
        y.backward(g)
    assert torch.allclose(xs[0].grad.float(), xs[1].grad.float(), rtol=2**-7, atol=1e-3)
    assert torch.allclose(native.weight.grad.float(), upcast.weight.grad.float(), rtol=2**-7, atol=1e-3)
    if bias:
        assert torch.allclose(native.bias.grad.float(), upcast.bias.grad.float(), rtol=2**-7, atol=1e-3)


def test_fp32_weights_under_autocast_give_bf16_and_frozen_weights_get_no_gradient() -> None:
    native, upcast = _pair(True, torch.float32)
    upcast.weight.requires_grad_(False)
    x = torch.randn(5, 96, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = upcast(x)
    y_native = _bf16_kernel(x.bfloat16(), native.bfloat16())  # what autocast computes: x, W, b cast to bf16
    assert y.dtype == y_native.dtype == torch.bfloat16
    assert torch.allclose(y.float(), y_native.float(), rtol=2**-6, atol=2e-2)  # autocast rounds x, W to bf16
    y.float().sum().backward()
    assert upcast.weight.grad is None and upcast.bias.grad is not None and x.grad is not None


def test_resolution_of_the_setting(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    amx, avx512 = tmp_path / "amx", tmp_path / "avx512"  # two files: the answer is cached per file
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n")
    avx512.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert cpu_has_amx(str(amx)) and not cpu_has_amx(str(avx512)) and not cpu_has_amx(str(tmp_path / "missing"))
    assert wants_fp32_kernel(True, True, cpu)
    assert not wants_fp32_kernel(True, False, cpu)  # fp32 compute: nothing to change
    assert not wants_fp32_kernel(False, True, cpu)
    assert not wants_fp32_kernel("auto", True, torch.device("meta"))  # not a CPU: the native kernel
    auto = wants_fp32_kernel("auto", True, cpu)
    assert auto == (not cpu_has_amx() and fp32_matmul.fp32_kernel_speedup(torch.get_num_threads()) >= 1.25)


def _best_seconds(fn, repeats: int = 5) -> float:
    import time

    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.serial  # a timing comparison: it owns the machine (tests/README.md)
def test_the_timing_probe_agrees_with_the_layers_it_chooses_for() -> None:
    """`auto`'s probe (a 512 x 1024 GEMM each way) says which kernel is faster on the shapes the demo's layers
    have (1024 tokens through a 576 -> 1536 layer, forward and backward), wherever the two clearly differ."""
    native, upcast = _pair(False, torch.bfloat16, (576, 1536))
    x = torch.randn(1024, 576, dtype=torch.bfloat16, requires_grad=True)

    def step(layer: torch.nn.Module) -> None:
        layer(x).float().sum().backward()

    layers = _best_seconds(lambda: step(native)) / _best_seconds(lambda: step(upcast))
    probe = fp32_matmul.fp32_kernel_speedup.__wrapped__(torch.get_num_threads())
    assert probe > 0
    if layers > 1.5 or layers < 1 / 1.5:  # a clear difference on the layers: the probe must see the same side
        assert (probe > 1) == (layers > 1), f"probe {probe:.2f} vs layers {layers:.2f}"


def _graded_batch(model_dir: Path) -> TensorDict:
    """Four prompts times four bf16 samples of the tiny model, with GRPO advantages from every third one right."""
    rollout = HFRolloutEngine(model_dir, dtype="bfloat16", apply_chat_template=False)
    batch = rollout.generate([Prompt(f"u{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)], SamplingParams(n=4), 0)
    token = A.outcome_to_token_rewards((torch.arange(16) % 3 == 0).float(), batch[T.RESPONSE_MASK])
    batch[T.ADVANTAGES], _ = A.compute_advantages("grpo", token, batch[T.RESPONSE_MASK], T.get_rows(batch, "uid"))
    return batch


def test_trainer_swaps_the_layers_and_trains_alike(tiny_model_dir: Path) -> None:
    """The bf16 trainer with `fp32_matmul: true` has every linear layer on the fp32 kernel and the same weight
    names; its log-probs and one train step match the native trainer's to bf16's resolution."""
    batch = _graded_batch(tiny_model_dir)

    def trainer(fp32: bool) -> PPOTrainer:
        train = TorchTrainingConfig(optim=OptimConfig(lr=1e-3), micro_batch_size=8, fp32_matmul=fp32)
        return PPOTrainer(TrainerSettings(str(tiny_model_dir), train=train, dtype="bfloat16"))

    native, upcast = trainer(False), trainer(True)
    assert not native.backend.fp32_matmul and upcast.backend.fp32_matmul
    linears = [m for m in upcast.backend.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is Fp32KernelLinear for m in linears)
    assert [k for k, _ in native.named_weights()] == [k for k, _ in upcast.named_weights()]
    mask = batch[T.RESPONSE_MASK].bool()
    lp = [t.logprobs(batch)["logprobs"][mask] for t in (native, upcast)]
    assert (lp[0] - lp[1]).abs().mean() < 0.02 and (lp[0] - lp[1]).abs().max() < 0.2
    m = [t.train_step(batch) for t in (native, upcast)]
    assert m[1]["pg_loss"] == pytest.approx(m[0]["pg_loss"], abs=0.02)
    assert m[1]["grad_norm"] == pytest.approx(m[0]["grad_norm"], rel=0.05)


def test_lora_adapters_take_the_fp32_kernel_too(tiny_model_dir: Path) -> None:
    """Under LoRA the adapters (fp32 weights, new plain layers) run on the fp32 kernel as well, not on the bf16
    GEMM that bf16 autocast gives them, and the attention is the fp32 one; only the adapters train, and one step
    matches the native LoRA trainer's."""
    batch = _graded_batch(tiny_model_dir)
    adapters = LoraSettings(rank=4, alpha=8.0).model_dump(mode="json")

    def trainer(fp32: bool) -> PPOTrainer:
        train = TorchTrainingConfig(
            optim=OptimConfig(lr=1e-3), micro_batch_size=8, fp32_matmul=fp32, bf16_autocast=True
        )
        return PPOTrainer(TrainerSettings(str(tiny_model_dir), train=train, dtype="bfloat16", lora=adapters))

    native, upcast = trainer(False), trainer(True)
    named = dict(upcast.backend.model.named_modules())
    lora_layers = [m for n, m in named.items() if n.endswith((".lora_A.default", ".lora_B.default"))]
    assert lora_layers and all(type(m) is Fp32KernelLinear for m in lora_layers)
    assert all(type(m) is not torch.nn.Linear for m in named.values())
    assert upcast.backend.model.config._attn_implementation in fp32_matmul.FP32_ATTENTION.values()  # through peft
    trained = [n for n, p in upcast.backend.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    m = [t.train_step(batch) for t in (native, upcast)]
    assert m[1]["pg_loss"] == pytest.approx(m[0]["pg_loss"], abs=0.02)
    assert m[1]["grad_norm"] == pytest.approx(m[0]["grad_norm"], rel=0.05)


class _MatmulDtypes(TorchDispatchMode):
    """Records the input dtype of every batched matmul (attention's scores and weighted values) run inside."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.ops.aten.bmm.default, torch.ops.aten.bmm.out):
            self.dtypes.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_attention_runs_in_fp32_and_matches_the_native_one(tiny_model_dir: Path, attention: str) -> None:
    """With the fp32 kernel a bf16 model's eager (or sdpa) attention multiplies fp32 copies of q, k, v: no
    bf16 batched matmul is left (they were a quarter of an AVX2 update), the same masks apply (left padding
    included), and log-probs and gradients match the native attention's to bf16's resolution."""
    from transformers import AutoModelForCausalLM

    def model(fp32: bool) -> torch.nn.Module:
        m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
        m.set_attn_implementation(attention)
        if fp32:
            assert fp32_matmul.use_fp32_attention(m) == fp32_matmul.FP32_ATTENTION[attention]
        return m

    ids = torch.randint(3, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row: the mask must reach the fp32 attention
    native, upcast = model(False), model(True)
    outs = []
    for m in (native, upcast):
        with _MatmulDtypes() as seen:
            logits = m(input_ids=ids, attention_mask=mask).logits.float()
            logp = torch.log_softmax(logits, -1)[mask.bool()]
            logp.mean().backward()
        outs.append((logp.detach(), m.model.layers[0].self_attn.q_proj.weight.grad.float(), seen.dtypes))
    if attention == "eager":  # sdpa's CPU kernel is not a bmm: only the values are compared
        assert outs[0][2] == {torch.bfloat16} and outs[1][2] == {torch.float32}
    assert (outs[0][0] - outs[1][0]).abs().mean() < 0.02
    assert torch.nn.functional.cosine_similarity(outs[0][1].flatten(), outs[1][1].flatten(), dim=0) > 0.99
