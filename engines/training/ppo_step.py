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

from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.models.vision import (
    concat_images,
    dummy_vision_pass,
    forward_kwargs,
    has_images,
    suppress,
    unwrap,
    vision_token_ids,
)
from rlstages.engines.rollout.decode import cache_arg, left_pad, output_cache, prefill
from rlstages.engines.rollout.vision_inputs import image_digest
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.training.microbatch import by_length, mini_batches

SUMMED = {"pg_loss", "entropy", "kl_loss", "vf_loss"}  # partial sums under the global normaliser
MAXED = {"logprob_diff_max", "kl_coef"}
Scalar = torch.Tensor | float  # a metric: a 0-dim GPU tensor (read once per optimizer step) or a float


def autocast(enabled: bool, device: str = "cpu") -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on `device` (a no-op context when disabled)."""
    return torch.autocast(device, dtype=torch.bfloat16, enabled=enabled)


def causal_lm_forward(
    model: Any,
    mb: TensorDict,
    temperature: float,
    bf16: bool,
    entropy_grad: bool = False,
    prompts: SharedPrompts | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, T] of `response_ids` (logits / temperature) and entropy (graph only if `entropy_grad`);
    with `prompts` (the step's prompts, forwarded once) only the response tokens go through the model here. A
    vision-language model's micro-batch without images runs a zero-weighted dummy pass through its vision tower
    (`vision.dummy_vision_pass`: sharded ranks stay in step)."""
    device = _device(model)
    labels = mb[T.RESPONSE_IDS].to(device)
    with autocast(bf16, device.type), dummy_vision_pass(model, needed=not has_images(mb)):
        logits = prompts.response_logits(model, mb) if prompts is not None else response_logits(model, mb, device)
    # one chunked pass (row chunks: no full-size fp32 copy of the logits) for both, sharing each chunk's logsumexp;
    # the entropy is a metric outside the graph unless an entropy bonus needs its gradient
    return A.chunked_logprobs_entropy(logits, labels, temperature, entropy_grad and torch.is_grad_enabled())


def response_logits(model: Any, mb: TensorDict, device: torch.device) -> torch.Tensor:
    """Logits [B, T, V] at the positions that predict the response tokens, prompt and response in one pass."""
    prompt, response = mb[T.PROMPT_IDS], mb[T.RESPONSE_IDS]
    ids = torch.cat([prompt, response], dim=1).to(device)
    images = forward_kwargs(mb, device)  # an image batch: its pixel values and M-RoPE positions [3, B, L]
    out = model(
        input_ids=ids,
        attention_mask=mb[T.ATTENTION_MASK].to(device),
        position_ids=images.pop("position_ids", None) if images else mb[T.POSITION_IDS].to(device),
        logits_to_keep=response.shape[1] + 1,
        use_cache=False,
        **images,
    )
    # a vision-language model's vision tokens are out of the distribution, as in the rollout (text rows too)
    return suppress(out.logits[:, :-1], vision_token_ids(unwrap(model).config))


class SharedPrompts:
    """Every distinct prompt of a train step's micro-batches forwarded once (`rollout.decode.prefill`: a
    group's rows share it, all share the chat template's common prefix); each micro-batch then runs only its
    response tokens on top of its rows' KV caches. Under grad, the caches and last logits enter each micro-batch
    as leaves; their gradients add up over the micro-batches and `backward` takes them through the prompts'
    forward once, so the accumulated gradient is the one of forwarding every row whole. The demo's step: 8
    prompts of ~47 tokens once (27 of them shared) instead of ~40% of 64 rows' prompts per micro-batch.
    An image batch (M-RoPE positions): a prompt is its tokens and its images (`_prompt_keys`), forwarded whole
    with its pixel values and positions (no common prefix between prompts), the responses at their positions."""

    def __init__(self, model: Any, mbs: list[TensorDict], bf16: bool) -> None:
        device = _device(model)
        self.images = T.ROPE_POSITION_IDS in mbs[0].keys()
        self.index: dict[Any, int] = {}
        self._rows: dict[int, torch.Tensor] = {}  # each micro-batch's rows' prompt indices, read once here
        firsts: list[tuple[TensorDict, int]] = []  # each distinct prompt's first (micro-batch, row)
        for mb in mbs:
            rows = []
            for r, key in enumerate(_prompt_keys(mb, self.images)):
                if key not in self.index:
                    self.index[key] = len(self.index)
                    firsts.append((mb, r))
                rows.append(self.index[key])
            self._rows[id(mb)] = torch.tensor(rows, device=device)
        tokens = [key[0] if self.images else key for key in self.index]
        ids, mask = left_pad([torch.tensor(t, dtype=torch.long) for t in tokens], torch.long)
        ids, mask = ids.to(device), mask.to(device)
        with autocast(bf16, device.type):
            if self.images:
                cache, logits, self.mask = _image_prefill(model, ids, mask, firsts)
            else:
                cache, logits, self.mask = prefill(model, ids, mask)
        self.config = model.config
        self._outputs = [t for layer in cache.layers for t in (layer.keys, layer.values)] + [logits]
        self._leaves = [t.detach().requires_grad_(t.requires_grad) for t in self._outputs]

    def response_logits(self, model: Any, mb: TensorDict) -> torch.Tensor:
        """`response_logits` of a micro-batch: its rows' prompt caches, then its response tokens."""
        from transformers import DynamicCache

        device = _device(model)
        rows = self._rows.get(id(mb))
        if rows is None:  # a micro-batch not given at construction
            rows = torch.tensor([self.index[k] for k in _prompt_keys(mb, self.images)], device=device)
        *kv, last = self._leaves
        cache = DynamicCache([(kv[i][rows], kv[i + 1][rows]) for i in range(0, len(kv), 2)], config=self.config)
        response = mb[T.RESPONSE_IDS].to(device)
        width = mb[T.PROMPT_IDS].shape[1]
        if self.images:  # M-RoPE [3, B, T]: the responses' positions do not depend on the prompts' padding
            positions = mb[T.ROPE_POSITION_IDS][:, :, width:].permute(1, 0, 2).to(device)
        else:
            positions = mb[T.POSITION_IDS][:, width:].to(device)
        tail = model(
            input_ids=response,
            attention_mask=torch.cat([self.mask[rows], mb[T.ATTENTION_MASK][:, width:].to(device)], dim=1),
            position_ids=positions,
            use_cache=True,
            logits_to_keep=response.shape[1],
            **cache_arg(unwrap(model), cache),
        )
        logits = torch.cat([last[rows].unsqueeze(1), tail.logits[:, :-1]], dim=1)
        return suppress(logits, vision_token_ids(unwrap(model).config))  # a text batch of a vision-language model

    def backward(self) -> None:
        """Take the gradients the micro-batches left on the prompt caches and logits through their forward."""
        outs, grads = [], []
        for out, leaf in zip(self._outputs, self._leaves, strict=True):
            if leaf.grad is not None:
                outs.append(out)
                grads.append(leaf.grad)
        if outs:
            torch.autograd.backward(outs, grads)
        self._outputs, self._leaves = [], []
        self._rows = {}


def _prompt_keys(mb: TensorDict, images: bool) -> list[Any]:
    """What makes each row's prompt the same as another's: its real tokens, and in an image batch its images
    (a digest: two prompts of the same text may hold different images; a group's rows hold one object)."""
    tokens = _prompt_tokens(mb)
    if not images:
        return list(tokens)
    digests: dict[int, bytes] = {}
    rows = T.get_multi_modal(mb)
    return [(t, digests.setdefault(id(mm), image_digest(mm))) for t, mm in zip(tokens, rows, strict=True)]


def _image_prefill(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, firsts: list[tuple[TensorDict, int]]
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """KV cache, last logits and mask of distinct image prompts (left-padded `ids`): each whole, its pixel values
    at its image tokens, its M-RoPE positions taken from the row (`firsts`: micro-batch, row) it was found in."""
    width = ids.shape[1]
    positions = torch.zeros(len(firsts), 3, width, dtype=torch.long)
    inputs = []
    rows_of: dict[int, list[dict[str, torch.Tensor]]] = {}  # each micro-batch's image inputs, read once
    for i, (mb, r) in enumerate(firsts):
        prompt_len = mb[T.PROMPT_IDS].shape[1]
        real = mb[T.ATTENTION_MASK][r, :prompt_len].bool()
        pos = mb[T.ROPE_POSITION_IDS][r, :, :prompt_len][:, real]
        positions[i, :, width - pos.shape[1] :] = pos
        if id(mb) not in rows_of:
            rows_of[id(mb)] = T.get_multi_modal(mb)
        inputs.append(rows_of[id(mb)][r])
    step = model(
        input_ids=ids, attention_mask=mask, position_ids=positions.permute(1, 0, 2).to(ids.device), use_cache=True,
        logits_to_keep=1, **concat_images(inputs, ids.device),
    )  # fmt: skip
    return output_cache(step), step.logits[:, -1], mask


def _prompt_tokens(mb: TensorDict) -> list[tuple[int, ...]]:
    """Each row's real prompt tokens (its left padding dropped), read in one transfer (not one per row)."""
    prompt = mb[T.PROMPT_IDS].cpu()
    mask = mb[T.ATTENTION_MASK][:, : prompt.shape[1]].cpu() > 0
    return [tuple(row[keep].tolist()) for row, keep in zip(prompt, mask, strict=True)]


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
) -> tuple[torch.Tensor, dict[str, Scalar]]:
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
    metrics = {k: scalar(v) for k, v in pg.items()}
    metrics["entropy"] = scalar(
        A.agg_loss(
            entropy.detach(), mask, params.loss_agg_mode, params.loss_scale_factor, **norm, dp_size=params.dp_size
        )
    )
    if check_sync and T.ROLLOUT_LOGPROBS in mb.keys():
        diff = (logp.detach() - mb[T.ROLLOUT_LOGPROBS].to(logp_dev)).abs()
        metrics["logprob_diff"] = scalar(A.masked_mean(diff, mask))
        metrics["logprob_diff_max"] = scalar((diff * mask).max()) if mask.numel() else 0.0  # no sync: shape only
    return loss, metrics


def critic_loss(
    vpreds: torch.Tensor, mb: TensorDict, cliprange_value: float, agg_mode: str, norm: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, Scalar]]:
    """Clipped value loss of one micro-batch and its metrics."""
    dev = vpreds.device
    mask = mb[T.RESPONSE_MASK].to(dev)
    loss, clipfrac = A.value_loss(
        vpreds, mb[T.RETURNS].to(dev), mb[T.VALUES].to(dev), mask, cliprange_value, agg_mode, **norm
    )
    return loss, {
        "vf_loss": scalar(loss),
        "vf_clipfrac": scalar(clipfrac),
        "vpred_mean": scalar(A.masked_mean(vpreds.detach(), mask)),
    }


def scalar(value: torch.Tensor | float) -> Scalar:
    """A metric's value without a host sync: a detached 0-dim tensor (float64) where it lives on an accelerator,
    a Python float where reading it costs nothing (the CPU). `floats` reads them all at once."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            return float(value.detach())
        return value.detach().reshape(()).to(torch.float64)
    return float(value)


def accumulate(acc: dict[str, Scalar], metrics: dict[str, Scalar], weight: Scalar) -> None:
    """Fold one micro-batch's metrics into the mini-batch's: losses add, rates are token-weighted, maxima max.
    Values stay where they are (device tensors are added on the device: no sync per micro-batch)."""
    for k, v in metrics.items():
        if k in MAXED:
            old = acc.get(k, v)
            both_floats = not isinstance(old, torch.Tensor) and not isinstance(v, torch.Tensor)
            acc[k] = max(old, v) if both_floats else torch.maximum(torch.as_tensor(old), torch.as_tensor(v))  # type: ignore[type-var]
        else:
            acc[k] = acc.get(k, 0.0) + (v if k in SUMMED else v * weight)


def floats(acc: dict[str, Scalar]) -> dict[str, float]:
    """The accumulated metrics as floats, every device tensor read in one transfer (one host sync)."""
    on_device = [k for k, v in acc.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in acc.items() if not isinstance(v, torch.Tensor)}
    if on_device:
        values = torch.stack([acc[k].reshape(()).to(torch.float64) for k in on_device]).tolist()  # type: ignore[union-attr]
        out.update(zip(on_device, values, strict=True))
    return {k: out[k] for k in acc}


def epochs_loop(
    batch: TensorDict,
    ppo_epochs: int,
    num_mini_batches: int,
    mini_step: Callable[[TensorDict, bool], dict[str, float]],
    prompt_once: bool = False,
) -> dict[str, float]:
    """Run `mini_step(mini, check_sync)` over epochs x mini-batches; average the metrics over optimizer steps.
    Each mini-batch reaches `mini_step` sorted by length (its loss is order-free; micro-batches pad less;
    `prompt_once`: by response length, each prompt going through the model once)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    first = True
    for _ in range(ppo_epochs):
        for mini in mini_batches(batch, num_mini_batches):
            for k, v in mini_step(by_length(mini, prompt_once)[0], first).items():
                sums[k] = sums.get(k, 0.0) + v
                counts[k] = counts.get(k, 0) + 1
            first = False
    return {k: sums[k] / counts[k] for k in sums}


def pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad [B, t] to [B, width] with zeros (micro-batches are trimmed to their own length)."""
    return x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))
