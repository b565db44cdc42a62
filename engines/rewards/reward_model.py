"""A reward model: a local `AutoModelForSequenceClassification` (one label) that scores (prompt, response).

The text is the tokenizer's chat template over a user and an assistant turn when the tokenizer has one,
else prompt + response. Samples are sorted by length and micro-batched; the score is read at the last
real token from the attention mask (not from `pad_token_id`, which breaks when pad == eos), with position
ids from the mask, so left and right padding give the same scores as one sample at a time.

Non-goals: training reward models, downloading from a hub, Ray (the caller wraps this class as an actor).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import cast

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlstages.engines.model_files import check_model_dir
from rlstages.engines.runtime.device import to_device, worker_device


def _first_line(err: BaseException) -> str:
    """`Type: first line of the message`, for one-line errors."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


class RewardModelEngine:
    """Scores responses with a sequence-classification reward model loaded from a local directory."""

    def __init__(
        self,
        path: str | Path,
        micro_batch_size: int = 8,
        max_length: int = 2048,
        dtype: str = "float32",
        num_threads: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {dtype!r} for the reward model")
        self.path = Path(path)
        check_model_dir(self.path, "reward.reward_model.path")  # the pre-flight's check, again in the worker
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                self.path, dtype=torch_dtype, use_safetensors=True, local_files_only=True
            )
        except Exception as err:
            raise ValueError(f"cannot load reward model from {self.path}: {_first_line(err)}") from err
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {self.path} has num_labels={self.model.config.num_labels}; expected 1")
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token_id is None:
                raise ValueError(f"tokenizer of reward model {self.path} has neither a pad nor an eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.truncation_side = "left"  # keep the response end, where the score is read
        # the worker starts here (the GPU Ray gave this actor, else the CPU) unless it was handed its device
        self.device = device if device is not None else worker_device()
        self.model.to(self.device).eval()
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length
        # Decoder reward models (Llama, Qwen, Mistral, GPT-2...) put a linear `score` head on every token;
        # then we run the base model and read the head at the last real token ourselves.
        self._head = getattr(self.model, "score", None)
        params = inspect.signature(self.model.base_model.forward).parameters
        self._takes_position_ids = "position_ids" in params

    def _text(self, prompt: str, response: str) -> str:
        """The text the model sees: chat template over user/assistant turns if present, else concatenation."""
        if self.tokenizer.chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return cast(str, self.tokenizer.apply_chat_template(messages, tokenize=False))  # tokenize=False: a str
        return prompt + response

    @torch.inference_mode()
    def _score_batch(self, texts: list[str]) -> list[float]:
        """Score one micro-batch of full texts."""
        enc = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            add_special_tokens=not self.tokenizer.chat_template,
            return_tensors="pt",
        )
        enc = to_device(dict(enc), self.device)
        mask = enc["attention_mask"]
        if self._head is None:  # encoder-style head (pooled first token): the model's own logits are right
            return self.model(**enc).logits[:, 0].float().tolist()
        inputs = {"input_ids": enc["input_ids"], "attention_mask": mask}
        if self._takes_position_ids:
            inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.model.base_model(**inputs).last_hidden_state
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last = (positions * mask).argmax(-1)  # index of the last real token, for either padding side
        rows = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return self._head(rows)[:, 0].float().tolist()

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """One scalar reward per (prompt, response), in input order."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        texts = [self._text(p, r) for p, r in zip(prompts, responses, strict=True)]
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths, less padding
        scores = [0.0] * len(texts)
        for start in range(0, len(order), self.micro_batch_size):
            chunk = order[start : start + self.micro_batch_size]
            for i, value in zip(chunk, self._score_batch([texts[i] for i in chunk]), strict=True):
                scores[i] = value
        return scores
