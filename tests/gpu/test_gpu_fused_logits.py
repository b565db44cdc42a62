"""The log-prob + entropy pass compiled for the GPU (`engines/algorithms/fused_logits.py`, Triton through
torch.compile), marked `gpu`: on CUDA bf16 logits of a 49k vocabulary, its log-probs, entropy and logits gradient
equal the eager chunks' (the path the CPU runs), for the gradients a loss can carry; and it really ran compiled
(no fall-back). Run: `python -m pytest -q -m gpu tests/gpu/test_gpu_fused_logits.py`."""

from __future__ import annotations

import pytest
import torch

from rlstages.engines.algorithms import fused_logits as F
from rlstages.engines.algorithms import logits as L

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_compiled_pass_equals_the_eager_chunks_on_cuda(entropy_grad: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(3, 100, 49152, device="cuda", generator=g) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 49152, (3, 100), device="cuda", generator=g)
    w_lp, w_ent = torch.randn(3, 100, device="cuda", generator=g), torch.randn(3, 100, device="cuda", generator=g)
    results = []
    for enabled in (True, False):
        F.KERNELS.enabled = enabled
        try:
            x = logits.clone().requires_grad_(True)
            lp, ent = L.chunked_logprobs_entropy(x, labels, 0.7, entropy_grad)
            loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if entropy_grad else 0.0)
            loss.backward()
            results.append((lp.detach(), ent.detach(), x.grad))
        finally:
            F.KERNELS.enabled = True
    assert not F.KERNELS.failed, F.KERNELS.failed  # the compiled kernels ran: no fall-back to the eager chunks
    (lp, ent, grad), (lp0, ent0, grad0) = results
    torch.testing.assert_close(lp, lp0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent, ent0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad.float(), grad0.float(), rtol=2e-2, atol=2e-2)
    assert grad.dtype == torch.bfloat16 and grad.abs().max() > 1e-4
