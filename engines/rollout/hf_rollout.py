"""HF transformers rollout engine: batched sampling with `generate`, the CPU default.

Log-probs are recorded inside generation by the only score-changing logits processor (ours), which
keeps one [B, V] tensor at a time: at step t it gathers the log-prob of the token sampled at t-1,
then stores log_softmax(logits / T) of step t. They match a teacher-forced recompute of the trainer.

Non-goal: continuous batching or paged KV cache (that is what the vLLM/SGLang backends are for).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from rlstages.engines.base import NamedTensors
from rlstages.engines.models import eos_token_ids, load_causal_lm, load_tokenizer
from rlstages.engines.rollout.batching import build_rollout_batch, format_prompts, truncate_response
from rlstages.engines.types import Prompt, SamplingParams


class _RecordLogprobs:
    """Logits processor: records sampled-token log-probs, then applies temperature / top-k / top-p."""

    def __init__(self, temperature: float, top_k: int, top_p: float) -> None:
        self.temperature = temperature if temperature > 0 else 1.0
        self.top_k, self.top_p = top_k, top_p
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def collect(self, last_tokens: torch.Tensor) -> None:
        """Gather the log-prob of the tokens just sampled from the stored distribution."""
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, last_tokens.view(-1, 1)).squeeze(-1))
            self.prev = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.collect(input_ids[:, -1])
        scaled = scores.float() / self.temperature
        self.prev = torch.log_softmax(scaled, dim=-1)
        return _top_k_top_p(scaled, self.top_k, self.top_p)


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


class HFRolloutEngine:
    """Sampling with transformers `generate`; weights updated in place by HF name."""

    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "bfloat16",
        batch_size: int = 64,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        chat_template: str | None = None,
        model_type: str | None = None,
    ) -> None:
        self.model_path = Path(model_path)
        self.model = load_causal_lm(model_path, dtype, model_type).eval()
        self.tokenizer = load_tokenizer(model_path)
        if chat_template:  # the configured template replaces the tokenizer's own
            self.tokenizer.chat_template = chat_template
        self.batch_size = batch_size
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.needs_weights = False
        self._shapes: dict[str, torch.Size] = {}

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], sampling: SamplingParams, seed: int) -> TensorDict:
        """`sampling.n` samples per prompt, rows prompt-major, with each sampled token's log-prob."""
        if self.needs_weights:
            raise RuntimeError("rollout engine woke from sleep without new weights: call update_weights first")
        prompt_ids = format_prompts(self.tokenizer, prompts, self.apply_chat_template, self.system_prompt)
        room = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) - sampling.max_new_tokens
        if room > 0:  # data.overlong_prompts=truncate (pre-flight refused them otherwise): keep the last tokens
            prompt_ids = [ids[-room:] for ids in prompt_ids]
        rows = [ids for ids in prompt_ids for _ in range(sampling.n)]
        torch.manual_seed(seed)
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        for start in range(0, len(rows), self.batch_size):
            ids, lps = self._generate_chunk(rows[start : start + self.batch_size], sampling)
            responses.extend(ids)
            logprobs.extend(lps)
        texts = [self._decode(r) for r in responses]
        responses, logprobs, texts = self._apply_stop(responses, logprobs, texts, sampling.stop)
        return build_rollout_batch(prompts, prompt_ids, responses, logprobs, texts, sampling.n, self.pad_id)

    def _generate_chunk(
        self, rows: list[list[int]], sampling: SamplingParams
    ) -> tuple[list[list[int]], list[list[float]]]:
        from transformers import LogitsProcessorList

        enc = self.tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")
        recorder = _RecordLogprobs(sampling.temperature, sampling.top_k, sampling.top_p)
        kwargs: dict[str, Any] = {}
        if sampling.stop:
            kwargs.update(stop_strings=list(sampling.stop), tokenizer=self.tokenizer)
        out = self.model.generate(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            logits_processor=LogitsProcessorList([recorder]),
            do_sample=not sampling.greedy,
            temperature=1.0,
            top_k=None,
            top_p=None,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            **kwargs,
        )
        new = out[:, enc["input_ids"].shape[1] :]
        if new.shape[1] > len(recorder.steps):
            recorder.collect(new[:, len(recorder.steps)])
        step_lp = torch.stack(recorder.steps, dim=1) if recorder.steps else torch.zeros(len(rows), 0)
        ids_out, lp_out = [], []
        for i in range(len(rows)):
            ids, lps = truncate_response(new[i].tolist(), step_lp[i].tolist(), self.eos_ids, sampling.max_new_tokens)
            ids_out.append(ids)
            lp_out.append(lps)
        return ids_out, lp_out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _apply_stop(
        self, responses: list[list[int]], logprobs: list[list[float]], texts: list[str], stop: tuple[str, ...]
    ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Cut each response after the first token at which a stop string has appeared."""
        if not stop:
            return responses, logprobs, texts
        for i, (ids, text) in enumerate(zip(responses, texts, strict=True)):
            if not any(s in text for s in stop):
                continue
            for k in range(1, len(ids) + 1):
                partial = self._decode(ids[:k])
                if any(s in partial for s in stop):
                    responses[i], logprobs[i], texts[i] = ids[:k], logprobs[i][:k], partial
                    break
        return responses, logprobs, texts

    def update_weights(self, named_tensors: NamedTensors) -> None:
        """Copy HF-named tensors into the model in place (cast to the rollout dtype), one at a time."""
        params = self.model.state_dict(keep_vars=True)
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"update_weights: {name!r} is not a weight of {type(self.model).__name__}")
            with torch.no_grad():
                params[name].copy_(torch.as_tensor(tensor))
        self.needs_weights = False

    def sleep(self) -> None:
        """Free the weights (parameters become empty; buffers such as RoPE tables stay)."""
        if self._shapes:
            return
        for name, param in self.model.named_parameters():
            self._shapes[name] = param.shape
            param.data = torch.empty(0, dtype=param.dtype)

    def wake(self) -> None:
        """Re-allocate the weights, empty: generation refuses to run until `update_weights` fills them."""
        if not self._shapes:
            return
        for name, param in self.model.named_parameters():
            param.data = torch.empty(self._shapes[name], dtype=param.dtype)
        self._shapes = {}
        self.needs_weights = True
