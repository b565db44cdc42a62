"""Per-token log-probs and entropy from logits, in float32 or wider (what every trainer backend reads).

Non-goal: computing the logits (the backends' forward passes).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

import rlstages.engines.algorithms.fused_logits as F


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(z) over the last dim, logsumexp(z) - sum softmax(z)*z, in float32 or wider."""
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / temperature) gathered at `labels` ([..., V] -> [...]), in float32 or wider.

    Dividing by the rollout temperature makes trainer log-probs match the sampler's (verl does the same).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature != 1.0:
        z = z / temperature
    picked = torch.gather(z, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


CHUNK_BYTES = 32 << 20  # fp32 working set per chunk on a GPU: full [B, T, V] fp32 logits are never built
# On the CPU a chunk is a few tokens' rows, not whole sequences: its float32 temporaries stay in the core's cache, and
# under jemalloc 5.3 (the workers' default heap) every freed block over 8 MB is handed back to the OS at once and
# page-faulted in again at the next allocation. The demo's [11, 47, 49152] logits in chunks of 3 sequences (28 MB)
# took 2.8x as long there as in chunks of 10 tokens (AMX Xeon, 2 threads; 1.6x under glibc: docs/benchmarks.md).
CPU_CHUNK_BYTES = 2 << 20
Index = tuple[int | slice, ...]


def _row_chunks(logits: Tensor, budget: int | None = None) -> int:
    """Rows of dim 0 per chunk of at most `budget` bytes of float32 (`CHUNK_BYTES` unset; at least one row)."""
    per_row = max(1, logits[0].numel() * 4)
    return max(1, (CHUNK_BYTES if budget is None else budget) // per_row)


def _chunks(logits: Tensor) -> list[Index]:
    """Index tuples that cut [..., V] logits into chunks: on a GPU whole rows of dim 0 (`_row_chunks`, as the fused
    kernels take them); on the CPU at most `CPU_CHUNK_BYTES` of float32 (at least one token), whole rows while one
    fits, else (row, token slice) pieces of [B, T, V] logits."""
    tokens = max(1, CPU_CHUNK_BYTES // (4 * logits.shape[-1]))  # token rows of V per chunk on the CPU
    if not logits.is_cuda and logits.dim() == 3 and tokens < logits.shape[1]:
        return [(b, slice(t, t + tokens)) for b in range(logits.shape[0]) for t in range(0, logits.shape[1], tokens)]
    step = _row_chunks(logits, None if logits.is_cuda else CPU_CHUNK_BYTES)
    return [(slice(s, s + step),) for s in range(0, logits.shape[0], step)]


def _scaled_chunks(logits: Tensor, temperature: float) -> Iterator[tuple[Index, Tensor]]:
    """(index, float32 copy of logits[index] / temperature), a chunk at a time (`_chunks`): what every chunked
    kernel here works on, forward and backward."""
    for rows in _chunks(logits):
        z = logits[rows].to(torch.float32, copy=True)
        if temperature != 1.0:
            z.div_(temperature)
        yield rows, z


class _ChunkedLogprobs(torch.autograd.Function):
    """log_softmax(logits / T) at `labels`, row chunk by row chunk, in float32. Saves only the logits as given
    (bf16 under autocast) and the per-token logsumexp; backward rebuilds softmax one chunk at a time. The same
    values and gradients as `logprobs_from_logits`, without its full-size float32 copies (for a 49k vocab,
    16 x 48 response tokens: ~150 MB each for the upcast, the scaled copy, exp and the gradient)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, temperature: float) -> Tensor:  # type: ignore[override]
        out = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for rows, z in _scaled_chunks(logits, temperature):
            lse[rows] = torch.logsumexp(z, dim=-1)
            out[rows] = torch.gather(z, -1, labels[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
        ctx.temperature = temperature
        ctx.save_for_backward(logits, labels, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, labels, lse = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.empty_like(logits)
        for rows, z in _scaled_chunks(logits, temperature):
            g = grad[rows].float().unsqueeze(-1)
            p = z.sub_(lse[rows].unsqueeze(-1)).exp_().mul_(g).neg_()  # -softmax * grad
            p.scatter_add_(-1, labels[rows].unsqueeze(-1), g)  # + onehot * grad
            if temperature != 1.0:
                p.div_(temperature)
            grad_logits[rows] = p
        return grad_logits, None, None


def chunked_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """`logprobs_from_logits` for [B, T, V] logits of any float dtype, computed in float32 a few rows at a time
    (forward and backward), so a large vocabulary never has its logits materialised whole in float32."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _ChunkedLogprobs.apply(logits, labels, float(temperature))


class _ChunkedEntropy(torch.autograd.Function):
    """Entropy of softmax(logits / T), row chunk by row chunk, in float32. Saves the logits as given and the
    per-token logsumexp and entropy; backward rebuilds softmax one chunk at a time, dH/dz = -p (z - E_p[z])
    with E_p[z] = logsumexp - H, so an entropy bonus needs no full-size float32 copy of the logits either."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, temperature: float) -> Tensor:  # type: ignore[override]
        out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for rows, z in _scaled_chunks(logits, temperature):
            chunk_lse = torch.logsumexp(z, dim=-1)
            lse[rows] = chunk_lse
            # H = lse - sum(p z) with p = exp(z - lse): one logsumexp per chunk, not a second one and a softmax
            out[rows] = chunk_lse - (z - chunk_lse.unsqueeze(-1)).exp_().mul_(z).sum(dim=-1)
        ctx.temperature = temperature
        ctx.save_for_backward(logits, lse, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        logits, lse, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.empty_like(logits)
        for rows, z in _scaled_chunks(logits, temperature):
            p = (z - lse[rows].unsqueeze(-1)).exp_()
            g = z.sub_((lse[rows] - entropy[rows]).unsqueeze(-1)).mul_(p).mul_(grad[rows].float().unsqueeze(-1)).neg_()
            if temperature != 1.0:
                g.div_(temperature)
            grad_logits[rows] = g
        return grad_logits, None


def chunked_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """`entropy_from_logits(logits / temperature)` for [B, T, V] logits of any float dtype, in float32 a few
    rows at a time (forward and backward: an entropy bonus differentiates through it), so a large vocabulary
    never has its logits materialised whole in float32."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _ChunkedEntropy.apply(logits, float(temperature))


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    """Log-probs at `labels` and entropy of softmax(logits / T) in ONE pass over the logits, row chunk by row
    chunk in float32: each chunk is upcast and scaled once and its logsumexp serves both (H = lse - sum p z, p z
    formed in place in one temporary). Backward writes one gradient of the logits for both outputs (the two separate
    kernels each wrote a full-size one that autograd then added) with few passes over a chunk: upcast, scale and
    subtract the logsumexp in one kernel, exp, one scale (-g / T folded), the label's +g / T, the cast back. The
    entropy's part only when it has a gradient (`entropy_grad`; otherwise it is a non-differentiable metric)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: Tensor, labels: Tensor, temperature: float, entropy_grad: bool
    ) -> tuple[Tensor, Tensor]:
        out = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        entropy = torch.empty_like(out)
        if not (_use_fused(logits) and _fused_forward(logits, labels, 1.0 / temperature, out, lse, entropy)):
            for rows, z in _scaled_chunks(logits, temperature):
                chunk_lse = torch.logsumexp(z, dim=-1)
                lse[rows] = chunk_lse
                out[rows] = torch.gather(z, -1, labels[rows].unsqueeze(-1)).squeeze(-1) - chunk_lse
                entropy[rows] = chunk_lse - (z - chunk_lse.unsqueeze(-1)).exp_().mul_(z).sum(dim=-1)  # p z in place
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, labels, lse, entropy)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, None, None, None]:
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None
        logits, labels, lse, entropy = ctx.saved_tensors
        inv_t = 1.0 / ctx.temperature
        grad_logits = torch.empty_like(logits)
        fused = _use_fused(logits) and _fused_backward(
            logits, labels, lse, entropy, grad_logp, grad_entropy, inv_t, grad_logits
        )
        if fused:
            return grad_logits, None, None, None
        for rows in _chunks(logits):
            w = _shifted(logits[rows], lse[rows], inv_t)
            g = grad_logp[rows].float().unsqueeze(-1) * inv_t if grad_logp is not None else None
            if grad_entropy is None:  # d logp / dz: (onehot - p) g / T
                p = w.exp_().mul_(-g)  # type: ignore[operator]
            else:  # dH / dz: -p (z/T - E_p[z/T]) gH / T, with z/T - E_p[z/T] = (z/T - lse) + H; plus -p g / T
                p = w.exp()
                w.add_(entropy[rows].unsqueeze(-1)).mul_(grad_entropy[rows].float().unsqueeze(-1) * inv_t)
                if g is not None:
                    w.add_(g)
                p = w.mul_(p).neg_()
            if g is not None:
                p.scatter_add_(-1, labels[rows].unsqueeze(-1), g)  # + onehot g / T
            grad_logits[rows] = p
        return grad_logits, None, None, None


def _shifted(logits: Tensor, lse: Tensor, inv_t: float, one_kernel: bool | None = None) -> Tensor:
    """The float32 tensor logits * inv_t - lse[..., None]. On a GPU (`one_kernel` unset) one mixed-dtype kernel
    (upcast, scale and subtract in one pass over the chunk: memory-bound, so a pass saved is time saved); on the
    CPU, where mixed-dtype elementwise kernels are slower than two plain ones, an upcast copy and in-place ops."""
    if logits.is_cuda if one_kernel is None else one_kernel:
        return torch.add(lse.unsqueeze(-1).neg(), logits, alpha=inv_t)
    z = logits.to(torch.float32, copy=True)
    if inv_t != 1.0:
        z.mul_(inv_t)
    return z.sub_(lse.unsqueeze(-1))


def chunked_logprobs_entropy(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, entropy_grad: bool = False
) -> tuple[Tensor, Tensor]:
    """`chunked_logprobs` and `chunked_entropy` of [B, T, V] logits in one chunked pass sharing each chunk's
    float32 copy and logsumexp. The entropy carries a gradient only with `entropy_grad` (an entropy bonus);
    otherwise it is a metric outside the graph and the backward computes the log-probs' gradient alone."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _ChunkedLogprobsEntropy.apply(logits, labels, float(temperature), bool(entropy_grad))


def _use_fused(logits: Tensor) -> bool:
    """Whether the log-prob + entropy pass runs through the compiled kernels: on a GPU, where Triton fuses them
    (on the CPU the eager chunks are as fast and compiling costs seconds per shape)."""
    return F.KERNELS.takes(logits)


def _fused_forward(logits: Tensor, labels: Tensor, inv_t: float, out: Tensor, lse: Tensor, entropy: Tensor) -> bool:
    """`_ChunkedLogprobsEntropy.forward`'s chunks through the compiled kernels (`fused_logits`); False where that
    path is off or does not compile here (the caller then runs the eager chunks)."""
    step = _row_chunks(logits)
    for s in range(0, logits.shape[0], step):
        rows = slice(s, s + step)
        got = F.KERNELS.run("chunk_forward", logits[rows], labels[rows], inv_t)
        if got is None:
            return False
        out[rows], lse[rows], entropy[rows] = got
    return True


def _fused_backward(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_logp: Tensor | None,
    grad_entropy: Tensor | None,
    inv_t: float,
    grad_logits: Tensor,
) -> bool:
    """`_ChunkedLogprobsEntropy.backward`'s chunks through the compiled kernels; False where that path is off."""
    step = _row_chunks(logits)
    for s in range(0, logits.shape[0], step):
        rows = slice(s, s + step)
        if grad_entropy is None:
            assert grad_logp is not None
            got = F.KERNELS.run("chunk_backward_logp", logits[rows], labels[rows], lse[rows], grad_logp[rows], inv_t)
        else:
            g = grad_logp[rows] if grad_logp is not None else torch.zeros_like(grad_entropy[rows])
            got = F.KERNELS.run(
                "chunk_backward", logits[rows], labels[rows], lse[rows], entropy[rows], g, grad_entropy[rows], inv_t
            )
        if got is None:
            return False
        grad_logits[rows] = got
    return True
