"""The backend-independent pieces of a PPO/GRPO training step, shared by every training engine.

Forward passes (log-probs, entropy, values of the response tokens), the per-micro-batch actor and critic
losses (normalised by the mini-batch's global token/sequence counts so gradient accumulation is exact),
the epochs x mini-batches loop, and metric aggregation. Engines supply the model, backward and step.

Non-goal: owning a model or optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.training.microbatch import by_length, mini_batches

SUMMED = {"pg_loss", "entropy", "kl_loss", "vf_loss"}  # partial sums under the global normaliser
MAXED = {"logprob_diff_max", "kl_coef"}


def autocast(enabled: bool, device: str = "cpu") -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on `device` (a no-op context when disabled)."""
    return torch.autocast(device, dtype=torch.bfloat16, enabled=enabled)


def causal_lm_forward(
    model: Any, mb: TensorDict, temperature: float, bf16: bool, entropy_grad: bool = False, share_prompt: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, T] of `response_ids` (logits / temperature) and entropy (graph only if `entropy_grad`);
    `share_prompt`: each distinct prompt of the micro-batch goes through the model once (`shared_prompt_logits`)."""
    device = _device(model)
    labels = mb[T.RESPONSE_IDS].to(device)
    with autocast(bf16, device.type):
        logits = shared_prompt_logits(model, mb, device) if share_prompt else response_logits(model, mb, device)
    logprobs = A.chunked_logprobs(logits, labels, temperature)  # row chunks: no full-size fp32 copy of the logits
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logprobs, A.chunked_entropy(logits, temperature)


def response_logits(model: Any, mb: TensorDict, device: torch.device) -> torch.Tensor:
    """Logits [B, T, V] at the positions that predict the response tokens, prompt and response in one pass."""
    prompt, response = mb[T.PROMPT_IDS], mb[T.RESPONSE_IDS]
    ids = torch.cat([prompt, response], dim=1).to(device)
    out = model(
        input_ids=ids,
        attention_mask=mb[T.ATTENTION_MASK].to(device),
        position_ids=mb[T.POSITION_IDS].to(device),
        logits_to_keep=response.shape[1] + 1,
        use_cache=False,
    )
    return out.logits[:, :-1]


def shared_prompt_logits(model: Any, mb: TensorDict, device: torch.device) -> torch.Tensor:
    """`response_logits` with each distinct prompt of the micro-batch forwarded once: its KV cache (in the
    autograd graph) is repeated for the rows that share it, then only response tokens go through the model.
    Rows stay sorted by length (little response padding); a micro-batch of 16 of the demo's rows holds ~6 of
    its 8 prompts, so ~40% of the prompt tokens are computed (40-token prompts, ~20-token replies)."""
    prompt, response = mb[T.PROMPT_IDS].to(device), mb[T.RESPONSE_IDS].to(device)
    mask, positions = mb[T.ATTENTION_MASK].to(device), mb[T.POSITION_IDS].to(device)
    width = prompt.shape[1]
    _, inverse = torch.unique(torch.cat([prompt, mask[:, :width]], dim=1), dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), len(inverse), device=device).scatter_reduce_(
        0, inverse, torch.arange(len(inverse), device=device), "amin"
    )  # one row standing for each distinct prompt
    head = model(
        input_ids=prompt[first],
        attention_mask=mask[first, :width],
        position_ids=positions[first, :width],
        use_cache=True,
        logits_to_keep=1,
    )
    cache = head.past_key_values
    cache.batch_select_indices(inverse)  # [distinct, ...] -> [B, ...], differentiable indexing
    tail = model(
        input_ids=response,
        attention_mask=mask,
        position_ids=positions[:, width:],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=response.shape[1],
    )
    return torch.cat([head.logits[inverse], tail.logits[:, :-1]], dim=1)


def value_forward(model: Any, mb: TensorDict, bf16: bool) -> torch.Tensor:
    """Values [B, T] of the response tokens, read at the positions that predict them."""
    prompt, response = mb[T.PROMPT_IDS], mb[T.RESPONSE_IDS]
    ids = torch.cat([prompt, response], dim=1).to(_device(model))
    with autocast(bf16, _device(model).type):
        out = model(
            input_ids=ids,
            attention_mask=mb[T.ATTENTION_MASK].to(ids.device),
            position_ids=mb[T.POSITION_IDS].to(ids.device),
        )
    return out.logits[:, prompt.shape[1] - 1 : -1, 0].float()


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def global_counts(mini: TensorDict) -> dict[str, torch.Tensor]:
    """The mini-batch normalisers: response tokens and non-empty sequences."""
    mask = mini[T.RESPONSE_MASK]
    return {"global_tokens": mask.sum().clamp(min=1.0), "global_seqs": (mask.sum(-1) > 0).sum().clamp(min=1).float()}


def actor_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    mb: TensorDict,
    params: A.PolicyLossParams,
    norm: dict[str, torch.Tensor],
    check_sync: bool,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss of one micro-batch (+ entropy / KL terms, times the batch's rollout IS weights if it has
    them) and its metrics; `logprob_diff` when checking the trainer against the rollout engine (before the
    first optimizer step of a train step).
    """
    logp_dev = logp.device
    mask = mb[T.RESPONSE_MASK].to(logp_dev)
    old = mb[T.OLD_LOGPROBS].to(logp_dev) if T.OLD_LOGPROBS in mb.keys() else logp.detach()
    ref = mb[T.REF_LOGPROBS].to(logp_dev) if params.use_kl_loss else None
    is_weights = mb[T.ROLLOUT_IS_WEIGHTS].to(logp_dev) if T.ROLLOUT_IS_WEIGHTS in mb.keys() else None
    loss, pg = A.policy_loss(
        old,
        logp,
        mb[T.ADVANTAGES].to(logp_dev),
        mask,
        params,
        **norm,
        entropy=entropy if params.entropy_coeff else None,
        ref_logprobs=ref,
        rollout_is_weights=is_weights,
    )
    metrics = {k: float(v) for k, v in pg.items()}
    metrics["entropy"] = float(
        A.agg_loss(
            entropy.detach(), mask, params.loss_agg_mode, params.loss_scale_factor, **norm, dp_size=params.dp_size
        )
    )
    if check_sync and T.ROLLOUT_LOGPROBS in mb.keys():
        diff = (logp.detach() - mb[T.ROLLOUT_LOGPROBS].to(logp_dev)).abs()
        metrics["logprob_diff"] = float(A.masked_mean(diff, mask))
        metrics["logprob_diff_max"] = float((diff * mask).max()) if mask.any() else 0.0
    return loss, metrics


def critic_loss(
    vpreds: torch.Tensor, mb: TensorDict, cliprange_value: float, agg_mode: str, norm: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss of one micro-batch and its metrics."""
    dev = vpreds.device
    mask = mb[T.RESPONSE_MASK].to(dev)
    loss, clipfrac = A.value_loss(
        vpreds, mb[T.RETURNS].to(dev), mb[T.VALUES].to(dev), mask, cliprange_value, agg_mode, **norm
    )
    return loss, {
        "vf_loss": float(loss.detach()),
        "vf_clipfrac": float(clipfrac),
        "vpred_mean": float(A.masked_mean(vpreds.detach(), mask)),
    }


def accumulate(acc: dict[str, float], metrics: dict[str, float], weight: float) -> None:
    """Fold one micro-batch's metrics into the mini-batch's: losses add, rates are token-weighted, maxima max."""
    for k, v in metrics.items():
        if k in MAXED:
            acc[k] = max(acc.get(k, v), v)
        else:
            acc[k] = acc.get(k, 0.0) + (v if k in SUMMED else v * weight)


def epochs_loop(
    batch: TensorDict, ppo_epochs: int, num_mini_batches: int, mini_step: Callable[[TensorDict, bool], dict[str, float]]
) -> dict[str, float]:
    """Run `mini_step(mini, check_sync)` over epochs x mini-batches; average the metrics over optimizer steps.
    Each mini-batch reaches `mini_step` sorted by length (its loss is order-free; micro-batches pad less)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    first = True
    for _ in range(ppo_epochs):
        for mini in mini_batches(batch, num_mini_batches):
            for k, v in mini_step(by_length(mini)[0], first).items():
                sums[k] = sums.get(k, 0.0) + v
                counts[k] = counts.get(k, 0) + 1
            first = False
    return {k: sums[k] / counts[k] for k in sums}


def pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad [B, t] to [B, width] with zeros (micro-batches are trimmed to their own length)."""
    return x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))
