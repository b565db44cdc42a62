"""The log-prob + entropy pass over one chunk of logits as two pure functions that `torch.compile` fuses on a GPU.

Eager, each chunk costs several full passes over a float32 copy of the logits (upcast, logsumexp, exp, product,
sum; then upcast, exp, scale, scatter and the cast back in the backward): memory-bound kernels that made the GRPO
update 0.91x plain transformers' on a Qwen2-1.5B shape (issue 41). Compiled, the forward reads the bf16 logits
in two reductions and writes only per-token values, and the backward is one pointwise kernel from the bf16
logits to the bf16 gradient: no float32 copy of a chunk is ever written. The functions are the same math as
`logits._ChunkedLogprobsEntropy` (tests/engines/algorithms/test_chunked_logits.py checks them against it on the CPU);
only CUDA tensors take the compiled path (`KERNELS`, an `engines.compiled.CompiledFunctions`), and a compiler
failure falls back to the eager chunks with a warning.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from rlstages.engines.compiled import CompiledFunctions


def chunk_forward(logits: Tensor, labels: Tensor, inv_t: float) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probs at `labels`, logsumexp and entropy of softmax(logits * inv_t) over the last dim, in float32."""
    z = logits.float() * inv_t
    lse = torch.logsumexp(z, dim=-1)
    logp = torch.gather(z, -1, labels.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.exp(z - lse.unsqueeze(-1)) * z).sum(dim=-1)
    return logp, lse, entropy


def chunk_backward(
    logits: Tensor, labels: Tensor, lse: Tensor, entropy: Tensor, grad_logp: Tensor, grad_entropy: Tensor, inv_t: float
) -> Tensor:
    """The gradient of the logits (their dtype) for both outputs of `chunk_forward`: (onehot - p) gL / T for the
    log-probs, -p (z/T - lse + H) gH / T for the entropy."""
    w = logits.float() * inv_t - lse.unsqueeze(-1)
    p = torch.exp(w)
    onehot = torch.arange(logits.shape[-1], device=logits.device) == labels.unsqueeze(-1)
    g = grad_logp.float().unsqueeze(-1) * inv_t
    h = grad_entropy.float().unsqueeze(-1) * inv_t
    grad = torch.where(onehot, g, 0.0) - p * (g + (w + entropy.unsqueeze(-1)) * h)
    return grad.to(logits.dtype)


def chunk_backward_logp(logits: Tensor, labels: Tensor, lse: Tensor, grad_logp: Tensor, inv_t: float) -> Tensor:
    """`chunk_backward` when only the log-probs have a gradient (the entropy a metric): (onehot - p) gL / T."""
    p = torch.exp(logits.float() * inv_t - lse.unsqueeze(-1))
    onehot = torch.arange(logits.shape[-1], device=logits.device) == labels.unsqueeze(-1)
    g = grad_logp.float().unsqueeze(-1) * inv_t
    return (torch.where(onehot, g, 0.0) - p * g).to(logits.dtype)


# the compiled path on CUDA (bench/bench_gpu.py turns `KERNELS.enabled` off to time the eager chunks; a whole run
# takes the eager chunks with RLSTAGES_COMPILED_LOGPROBS=0, which the driver passes on to its workers)
COMPILED_ENV = "RLSTAGES_COMPILED_LOGPROBS"
KERNELS = CompiledFunctions(
    {"chunk_forward": chunk_forward, "chunk_backward": chunk_backward, "chunk_backward_logp": chunk_backward_logp},
    "fused log-prob kernel",
)
KERNELS.enabled = os.environ.get(COMPILED_ENV, "1") != "0"
