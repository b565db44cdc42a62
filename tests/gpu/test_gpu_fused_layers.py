"""The decoder's RMSNorm, SwiGLU and rotary embedding compiled for the GPU's update (`engines/models/fused_layers.py`,
Triton through torch.compile), marked `gpu`: on CUDA, a bf16 Qwen2-shaped model routed to the fused kernels
gives transformers' logits and parameter gradients in a training forward + backward, and it really ran compiled
(no fall-back). Run: `python -m pytest -q -m gpu tests/gpu/test_gpu_fused_layers.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlstages.engines.models import fused_layers as FL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_routed_model_trains_as_transformers_on_cuda(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from rlstages.engines.models import build_tiny_model

    build_tiny_model(tmp_path, hidden_size=256, intermediate_size=704, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda()
    ids = torch.randint(3, 40, (4, 200), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))

    def forward_backward() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits.float()
        torch.log_softmax(logits, -1)[..., 5].mean().backward()
        return logits.detach(), [p.grad.float().clone() for p in model.parameters()]

    want, want_grads = forward_backward()
    assert FL.fuse_elementwise(model) == {"rms_norm": 5, "swiglu": 2, "rotary": 2}
    got, got_grads = forward_backward()
    assert sorted(FL.KERNELS.compiled) == ["rms_norm", "rotary", "swiglu"] and not FL.KERNELS.failed, FL.KERNELS.failed
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2 * b.abs().max().item() + 1e-4)
