"""HF transformers rollout engine: batched sampling with our own KV-cache decode loop, the CPU default.

Decoding is our own, not `generate`: text prompts go through a `slots.SlotDecoder` (continuous batching: a
finished row leaves the batch and the KV cache at once and a pending row takes its slot), multi-turn and image
prompts through `decode.decode` (one-shot batches). The log-prob of each sampled token is read from the
distribution it was drawn from (`decode.picker`); they match a teacher-forced recompute of the trainer.

Non-goal: paged KV cache (that is what the vLLM/SGLang backends are for).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlstages.engines.base import NamedTensors
from rlstages.engines.models import eos_token_ids, load_causal_lm, load_tokenizer
from rlstages.engines.models.moe_layout import ExpertSlots
from rlstages.engines.models.vision import is_vision_model, module_name, suppress, vision_token_ids
from rlstages.engines.rollout.batching import build_rollout_batch, format_prompts, truncate_response
from rlstages.engines.rollout.compiled_step import CompiledDecode, compiled_step
from rlstages.engines.rollout.decode import Picker, decode, picker
from rlstages.engines.rollout.fast_step import FastLlamaStep, fast_step, rollout_compute_dtype, unsupported
from rlstages.engines.rollout.multi_turn import build_runner, multi_turn_enabled
from rlstages.engines.rollout.slots import HFStep, RowRequest, SlotDecoder, run_rows
from rlstages.engines.rollout.streaming import StreamingMixin
from rlstages.engines.rollout.trajectory import build_trajectory_batch
from rlstages.engines.rollout.vision_inputs import (
    ImageBatch,
    ImagePrompt,
    add_image_fields,
    encode_image_prompts,
    load_image_processor,
)
from rlstages.engines.runtime.device import free_cached, to_device, worker_device
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.types import Prompt, SamplingParams

AUTO_CPU_STEP = "fast"  # `decode_step: auto` on CPU (docs/benchmarks.md: the compiled step measured against it)


class HFRolloutEngine(StreamingMixin):
    """Sampling with a transformers model through `decode.decode`, on the worker's device (its GPU, else the
    CPU); weights updated in place by HF name; streaming for partial rollouts (`streaming.StreamingMixin`)."""

    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "bfloat16",
        batch_size: int = 64,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        chat_template: str | None = None,
        model_type: str | None = None,
        attention: str = "eager",
        multi_turn: Any = None,
        image_pixels: tuple[int | None, int | None] = (None, None),
        device: torch.device | None = None,
        decode_step: str = "auto",
        fp32_weights: bool | str = "auto",
    ) -> None:
        self.model_path = Path(model_path)
        self.device = device if device is not None else worker_device()  # None: the worker starts here
        self.model = load_causal_lm(model_path, dtype, model_type, device=self.device).eval()
        self.model.set_attn_implementation(attention)  # eager decodes faster on CPU (configs.rollout)
        self.tokenizer = load_tokenizer(model_path)
        if chat_template:  # the configured template replaces the tokenizer's own
            self.tokenizer.chat_template = chat_template
        self.batch_size = batch_size
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt
        self.eos_ids = eos_token_ids(self.tokenizer, self.model.generation_config)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.needs_weights = False
        self.decode_step = decode_step  # "auto" | "compiled" | "fast" | "eager" (configs.rollout)
        self.compiled = CompiledDecode()  # the compiled decode function: kept across generations and updates
        self.said: set[str] = set()  # the fallback lines already logged (once per engine, not per generate)
        self.fp32_weights = fp32_weights  # the fast step's weights widened to fp32 (True, False, "auto")
        self.policy_version = 0  # stamped on each sampled token (`types.ROLLOUT_VERSIONS`)
        # KV cache blocks back to the GPU after generating, for another process on it (the hybrid engine turns it
        # off where the trainer shares this process's allocator and no other process shares the GPU)
        self.shares_device = True
        self._shapes: dict[str, torch.Size] = {}
        self.multi_turn = multi_turn if multi_turn_enabled(multi_turn) else None
        self._expert_slots = ExpertSlots(self.model)  # on-disk MoE expert names -> slices of fused parameters
        # a vision-language model: its image processor (data.image_min_pixels / image_max_pixels)
        self.image_processor = load_image_processor(model_path, *image_pixels) if is_vision_model(self.model) else None

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], sampling: SamplingParams, seed: int) -> TensorDict:
        """`sampling.n` samples per prompt, rows prompt-major, with each sampled token's log-prob."""
        if self.needs_weights:
            raise RuntimeError("rollout engine woke from sleep without new weights: call update_weights first")
        if self.multi_turn is not None:
            return self._generate_multi_turn(prompts, sampling, seed)
        encoded = None
        if self.image_processor is not None:  # image tokens expanded, pixel values and M-RoPE positions per prompt
            encoded = encode_image_prompts(
                self.model, self.tokenizer, self.image_processor, prompts, self.apply_chat_template, self.system_prompt
            )
            prompt_ids = [p.ids for p in encoded]
        else:
            prompt_ids = format_prompts(self.tokenizer, prompts, self.apply_chat_template, self.system_prompt)
        room = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) - sampling.max_new_tokens
        if room > 0 and encoded is None:  # data.overlong_prompts=truncate (refused otherwise): keep the last tokens
            prompt_ids = [ids[-room:] for ids in prompt_ids]
        rows = [ids for ids in prompt_ids for _ in range(sampling.n)]
        row_images = [p for p in encoded for _ in range(sampling.n)] if encoded is not None else None
        torch.manual_seed(seed)
        if row_images is None:  # text prompts: continuous batching over the slots (`slots.SlotDecoder`)
            responses, logprobs, versions = self._generate_slots(rows, sampling)
        else:  # image prompts keep the one-shot decode per chunk (`decode.decode` with M-RoPE positions)
            responses, logprobs, versions = [], [], None
            for start in range(0, len(rows), self.batch_size):
                chunk = row_images[start : start + self.batch_size]
                ids, lps = self._generate_chunk(rows[start : start + self.batch_size], sampling, chunk)
                responses.extend(ids)
                logprobs.extend(lps)
        if self.shares_device:
            free_cached(self.device)  # the KV cache is gone: its blocks go back to the GPU before the update
        texts = [self._decode(r) for r in responses]
        responses, logprobs, texts = self._apply_stop(responses, logprobs, texts, sampling.stop)
        if versions is not None:  # a stop string may have cut a row: its versions follow
            versions = [v[: len(r)] for v, r in zip(versions, responses, strict=True)]
        batch = build_rollout_batch(prompts, prompt_ids, responses, logprobs, texts, sampling.n, self.pad_id, versions)
        if row_images is not None:  # carried to the trainer: unpadded image inputs, positions computed once here
            add_image_fields(batch, row_images)
        return batch

    def _generate_multi_turn(self, prompts: list[Prompt], sampling: SamplingParams, seed: int) -> TensorDict:
        """`sampling.n` multi-turn trajectories per prompt (`rollout.multi_turn`), one row each (or one per turn
        when the template is not prefix-preserving and `new_row` was chosen)."""
        window = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        runner = build_runner(
            self.multi_turn,
            self.tokenizer,
            self.eos_ids,
            self.system_prompt,
            lambda contexts, limits: self.generate_ids(contexts, limits, sampling),
            window,
        )
        torch.manual_seed(seed)
        trajectories = runner.run(prompts, sampling.n, seed)
        if self.shares_device:
            free_cached(self.device)
        return build_trajectory_batch(trajectories, self.pad_id, self.tokenizer.decode)

    @torch.no_grad()
    def generate_ids(
        self, contexts: list[list[int]], limits: list[int], sampling: SamplingParams
    ) -> list[tuple[list[int], list[float]]]:
        """Token ids in, token ids out: one sample continuing each context, at most its own limit of tokens,
        cut after its first EOS (kept), with the sampled tokens' log-probs. The caller seeds torch."""
        out: list[tuple[list[int], list[float]]] = []
        pick = self._picker(sampling)
        for start in range(0, len(contexts), self.batch_size):
            rows, caps = contexts[start : start + self.batch_size], limits[start : start + self.batch_size]
            enc = to_device(
                dict(self.tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")), self.device
            )
            dec = decode(self.model, enc["input_ids"], enc["attention_mask"], max(caps), self.eos_ids, pick, None, caps)
            out.extend(
                truncate_response(ids, lps, self.eos_ids, cap)
                for ids, lps, cap in zip(dec.ids, dec.logprobs, caps, strict=True)
            )
        return out

    def _generate_slots(
        self, rows: list[list[int]], sampling: SamplingParams
    ) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """Every row through one `SlotDecoder` of `batch_size` slots, freed slots refilled from the pending rows
        (prompt-major); each row's ids, log-probs and per-token policy versions, in the rows' order."""
        columns = max(map(len, rows), default=1) + sampling.max_new_tokens + 1
        step = self._fast_step(min(self.batch_size, len(rows)), columns) or HFStep(self.model, self.device)
        decoder = SlotDecoder(min(self.batch_size, len(rows)), step, self.eos_ids, self._stop_check(sampling.stop))
        decoder.version = self.policy_version
        requests = [RowRequest(i, ids, sampling.max_new_tokens) for i, ids in enumerate(rows)]
        # inference mode: no autograd bookkeeping on the loop's small ops (a greedy 64-prompt evaluation ~7 % faster on
        # the AMX Xeon); the decoder and a call-scoped step end with this call and what leaves it is Python lists
        mode = torch.inference_mode() if step.CALL_SCOPED else contextlib.nullcontext()
        with mode:
            done = run_rows(decoder, requests, self._picker(sampling))
        out = [done[i] for i in range(len(rows))]
        return [r.ids for r in out], [r.logprobs for r in out], [r.versions for r in out]

    def _fast_step(self, slots: int, columns: int) -> FastLlamaStep | None:
        """The static-cache step where it applies (`decode_step`: auto takes `AUTO_CPU_STEP` on CPU): compiled
        (falling back to the fast eager one) or fast, in the compute dtype `rollout_compute_dtype` chooses;
        None: the eager transformers step."""
        kind = AUTO_CPU_STEP if self.decode_step == "auto" and self.device.type == "cpu" else self.decode_step
        if kind not in ("fast", "compiled"):
            return None
        dtype = rollout_compute_dtype(next(self.model.parameters()).dtype, self.device, self.fp32_weights)
        reason = unsupported(self.model)
        if kind == "compiled" and reason is None:
            step = compiled_step(self.model, slots, dtype, columns, self.compiled)
            if step is not None:
                return step
        return fast_step(self.model, slots, dtype, columns, self.said)

    def _generate_chunk(
        self, rows: list[list[int]], sampling: SamplingParams, images: list[ImagePrompt] | None = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        enc = to_device(dict(self.tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")), self.device)
        pick = self._picker(sampling)
        batch_images = ImageBatch.of(images, enc["input_ids"].shape[1], self.device) if images is not None else None
        out = decode(
            self.model,
            enc["input_ids"],
            enc["attention_mask"],
            sampling.max_new_tokens,
            self.eos_ids,
            pick,
            self._stop_check(sampling.stop),
            images=batch_images,
        )
        pairs = [
            truncate_response(ids, lps, self.eos_ids, sampling.max_new_tokens)
            for ids, lps in zip(out.ids, out.logprobs, strict=True)
        ]
        return [ids for ids, _ in pairs], [lps for _, lps in pairs]

    def _picker(self, sampling: SamplingParams) -> Picker:
        """The sampler; a vision-language model's vision tokens are never sampled (`vision.vision_token_ids`)."""
        pick = picker(sampling.temperature, sampling.top_k, sampling.top_p, sampling.greedy)
        if self.image_processor is None:
            return pick
        banned = vision_token_ids(self.model.config)
        return lambda logits: pick(suppress(logits, banned))

    def _stop_check(self, stop: tuple[str, ...]) -> Callable[[list[int]], bool] | None:
        """Whether a row's text so far ends in a stop string (its last few tokens decoded; `_apply_stop` then
        cuts it exactly)."""
        if not stop:
            return None
        tail = max(len(s) for s in stop) + 4  # every token is at least one character, bar partial bytes

        def stopped(ids: list[int]) -> bool:
            text = self._decode(ids[-tail:])
            return any(s in text for s in stop)

        return stopped

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
        """Copy HF-named tensors into the model in place (cast to the rollout dtype), one at a time; MoE experts
        may come in the on-disk layout (one tensor per expert), copied into their slice of the fused weight."""
        params = self.model.state_dict(keep_vars=True)
        for name, tensor in named_tensors:
            index: tuple = ()
            if name not in params and self.image_processor is not None:
                name = module_name(name)  # a VLM checkpoint's on-disk names (`visual.*`, `model.layers.*`) map too
            if name not in params:
                slot = self._expert_slots.target(name)
                if slot is None:
                    raise KeyError(f"update_weights: {name!r} is not a weight of {type(self.model).__name__}")
                name, index = slot
            with torch.no_grad():
                params[name][index].copy_(torch.as_tensor(tensor))
        self.needs_weights = False

    def adopt_weights(self, named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
        """Make these tensors the model's weights, without a copy, where shape and dtype match; returns the
        others, for the caller to copy in with `update_weights`. The caller's memory becomes the weights: a
        same-node trainer casts the next sync straight into them (`sync.collective.wire.send_weights`)."""
        params = self.model.state_dict(keep_vars=True)
        rest = []
        for name, tensor in named_tensors:
            if name not in params and self.image_processor is not None:
                name = module_name(name)
            if name not in params and self._expert_slots.target(name) is not None:
                rest.append((name, tensor))  # one expert of a fused MoE weight: copied in by update_weights
                continue
            if name not in params:
                raise KeyError(f"adopt_weights: {name!r} is not a weight of {type(self.model).__name__}")
            target = params[name]
            if self._shapes.get(name, target.shape) == tensor.shape and target.dtype == tensor.dtype:
                target.data = tensor.detach()
                self._shapes.pop(name, None)  # asleep: this one needs no re-allocation
            else:
                rest.append((name, tensor))
        self.needs_weights = bool(rest) or bool(self._shapes)
        return rest

    def sleep(self) -> None:
        """Free the weights (parameters become empty; buffers such as RoPE tables stay)."""
        if self._shapes:
            return
        for name, param in self.model.named_parameters():
            self._shapes[name] = param.shape
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def wake(self) -> None:
        """Re-allocate the freed weights, empty: generation refuses to run until `update_weights` fills them."""
        if not self._shapes:
            return
        for name, param in self.model.named_parameters():
            if name in self._shapes:  # not those adopted since the sleep
                param.data = torch.empty(self._shapes[name], dtype=param.dtype, device=self.device)
        self._shapes = {}
        self.needs_weights = True
