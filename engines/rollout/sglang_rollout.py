"""SGLang rollout engine: `sglang.Engine` sampling from token ids, `update_weights_from_tensor`, memory release.

GPU only: SGLang ships no CPU build, so this backend cannot run on a CPU machine; it is written against the
`sglang.Engine` API of sglang 0.5.23 (keyword names are checked by tests/engines/rollout/test_sglang_rollout.py
wherever sglang imports). sglang is imported lazily, so this module imports without it.

Sleep releases the KV cache, weights and CUDA graphs (`release_memory_occupation`), with the weights backed
up in host memory (`enable_weights_cpu_backup`), so `wake` alone restores a working engine (vLLM's level 1).

Weights come in two ways, each inside one of SGLang's weight-update sessions (`begin_weight_update` ...
`end_weight_update`, required since 0.5.2x): `update_weights` (tensors handed to this actor, colocated with
the trainer on its GPU: per bucket one `FlattenedTensorBucket`, serialised once per TP rank by SGLang's
`MultiprocessingSerializer` as CUDA IPC handles, `update_weights_from_tensor(load_format="flattened_bucket")`,
as slime does), and split placement's collective sync (`BucketReceiver`): SGLang's TP workers
join the trainer's broadcast group (`init_weights_update_group`), the trainer sends each bucket's names, dtypes
and shapes to this actor through Ray and broadcasts the bucket as one flat tensor, which SGLang receives with
`update_weights_from_distributed(..., load_format="flattened_bucket")` (`rlstages.engines.sync.collective`).

Image prompts (Qwen2-VL / Qwen2.5-VL; written against SGLang's API, never run: no CPU build): each prompt is
encoded as the HF rollout does it (`rollout.vision_inputs.encode_image_prompts`; the model's class on the meta
device for `get_rope_index`), and sent as `input_ids` (image tokens expanded) with `image_data` holding one
`{"format": "processor_output", "pixel_values", "image_grid_thw"}` dict per request: SGLang takes token ids with
preprocessed images as they are (no re-tokenisation, no resize), so its model sees our ids and pixels. The engine
runs with `limit_mm_data_per_request` (images: `data.max_images_per_prompt`); vision tokens get a -100 logit
bias; the batch carries the HF rollout's `multi_modal_inputs` and `rope_position_ids`. Weights go to SGLang under
their on-disk names (`visual.*`, `model.layers.*`: `vision.checkpoint_name`), the names its Qwen2-VL loads.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from rlstages.engines.base import NamedTensors
from rlstages.engines.models.vision import VISION_MODEL_TYPES, checkpoint_name, vision_token_ids
from rlstages.engines.rollout.batching import build_rollout_batch, format_prompts, truncate_response
from rlstages.engines.rollout.sglang_streaming import SGLangStreamingMixin, request_params
from rlstages.engines.rollout.vision_inputs import (
    ImagePrompt,
    add_image_fields,
    encode_image_prompts,
    load_image_processor,
    rope_model,
)
from rlstages.engines.runtime.device import worker_device
from rlstages.engines.sync.buckets import DEFAULT_BUCKET_BYTES, tensor_buckets
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.types import Prompt, SamplingParams
from rlstages.engines.utils import torch_dtype

WEIGHTS, KV_CACHE = "weights", "kv_cache"


class SGLangRolloutEngine(SGLangStreamingMixin):
    """`RolloutEngine` on `sglang.Engine`: n samples per prompt with the sampled tokens' log-probs; streams (partial
    rollouts, `sglang_streaming.py`: written against SGLang's API, not run)."""

    wakes_weights_alone = True  # update_weights wakes only the weights; the KV cache waits for generate

    def __init__(
        self,
        model_path: str,
        dtype: str = "bfloat16",
        tp_size: int = 1,
        mem_fraction_static: float = 0.5,
        enable_memory_saver: bool = True,
        max_model_len: int = 1024,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        chat_template: str | None = None,
        seed: int = 0,
        image_pixels: tuple[int | None, int | None] = (None, None),
        max_images_per_prompt: int = 4,
        device: torch.device | None = None,
    ) -> None:
        import sglang
        from transformers import AutoConfig, AutoTokenizer

        self.device = device if device is not None else worker_device()  # the worker starts here (weight sync's)
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt
        self.memory_saver = enable_memory_saver
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        model_path = str(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if chat_template:  # the configured template replaces the tokenizer's own
            self.tokenizer.chat_template = chat_template
        eos = self.tokenizer.eos_token_id
        self.eos_ids = {int(eos)} if eos is not None else set()
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else min(self.eos_ids, default=0)
        self.tp_size = tp_size
        self.dtype = torch_dtype(dtype)
        # a vision-language model: prompts encoded here as the HF rollout encodes them (module doc)
        self.image_model: Any = None
        self.image_processor: Any = None
        self.vision_ids: list[int] = []
        max_images = None
        if AutoConfig.from_pretrained(model_path).model_type in VISION_MODEL_TYPES:
            self.image_model = rope_model(model_path)
            self.image_processor = load_image_processor(model_path, *image_pixels)
            self.vision_ids = vision_token_ids(self.image_model.config)
            max_images = max_images_per_prompt
        self.engine = sglang.Engine(
            **engine_kwargs(
                model_path, dtype, tp_size, mem_fraction_static, enable_memory_saver, max_model_len, seed, max_images
            )
        )
        self._released: set[str] = set()

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, seed: int) -> TensorDict:
        """Sample `sampling.n` responses per prompt (rows prompt-major).

        Each row is its own request with its own `sampling_seed`; SGLang honours per-request seeds only
        when the engine runs with `enable_deterministic_inference`, otherwise samples vary run to run.
        """
        self.wake()
        encoded: list[ImagePrompt] | None = None
        if self.image_model is not None:  # image tokens expanded, pixel values and M-RoPE positions per prompt
            chat = (self.apply_chat_template, self.system_prompt)
            encoded = encode_image_prompts(self.image_model, self.tokenizer, self.image_processor, prompts, *chat)
            prompt_ids = [e.ids for e in encoded]
        else:
            prompt_ids = format_prompts(self.tokenizer, prompts, self.apply_chat_template, self.system_prompt)
        n = sampling.n
        rows = [prompt_ids[i // n] for i in range(len(prompts) * n)]
        params = [request_params(sampling, (seed * 1_000_003 + r) % 2**63, self.vision_ids) for r in range(len(rows))]
        extra: dict[str, Any] = {}
        if encoded is not None and any(e.inputs for e in encoded):
            extra["image_data"] = [image_data(encoded[i // n]) for i in range(len(rows))]
        outputs = self.engine.generate(input_ids=rows, sampling_params=params, return_logprob=True, **extra)
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        for out in outputs:
            # Each entry: (log-prob, token id, token text or None).
            entries = out["meta_info"]["output_token_logprobs"]
            ids, lps = truncate_response(
                [int(e[1]) for e in entries], [float(e[0]) for e in entries], self.eos_ids, sampling.max_new_tokens
            )
            responses.append(ids)
            logprobs.append(lps)
        # one sequence per call decodes to a str (the stub's `str | list[str]` covers batched input)
        texts = cast("list[str]", [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses])
        batch = build_rollout_batch(prompts, prompt_ids, responses, logprobs, texts, n, self.pad_id)
        if encoded is not None:  # the trainer recomputes log-probs from these, as for the HF rollout
            add_image_fields(batch, [e for e in encoded for _ in range(n)])
        return batch

    def update_weights(self, named_tensors: NamedTensors) -> None:
        """Load HF-named tensors in place, bucket by bucket, then flush the radix (prefix) cache."""
        if WEIGHTS in self._released:
            self.engine.resume_memory_occupation(tags=[WEIGHTS])
            self._released.discard(WEIGHTS)
        rename = checkpoint_name if self.image_model is not None else str  # a VLM: the names SGLang loads
        stream = ((rename(name), _cast(t, self.dtype)) for name, t in named_tensors)
        _check(self.engine.begin_weight_update(), "begin_weight_update")
        try:
            for bucket in tensor_buckets(stream, self.bucket_bytes):
                payloads = flattened_payloads(bucket, self.tp_size)
                result = self.engine.update_weights_from_tensor(
                    named_tensors=payloads, load_format="flattened_bucket", flush_cache=False
                )
                _check(result, "update_weights_from_tensor")
                del payloads, bucket  # SGLang's ranks hold their own references until they have loaded
        finally:
            _check(self.engine.end_weight_update(), "end_weight_update")
            self.engine.flush_cache()

    def weight_group_size(self) -> int:
        """Processes this engine adds to a weight-sync group: its TP workers."""
        return self.tp_size

    def join_weight_group(
        self, name: str, addr: str, port: int, rank: int, world: int, timeout: float, shm_path: str | None, host: str
    ) -> None:
        """SGLang's TP workers join the group `name` at ranks `rank`... (`shm_path` and `host` are not used:
        SGLang forms the group itself; the source joins it as SGLang's trainer side does)."""
        result = self.engine.init_weights_update_group(
            master_address=addr,
            master_port=port,
            rank_offset=rank,
            world_size=world,
            group_name=name,
            backend="nccl",  # SGLang runs on GPUs only
        )
        _check(result, "init_weights_update_group")

    def begin_weight_group_update(self, name: str) -> None:
        """Wake if asleep, then open SGLang's weight-update session for a sync through group `name`."""
        self.wake()
        _check(self.engine.begin_weight_update(), "begin_weight_update")

    def receive_weight_bucket(self, name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> int:
        """Receive one flat bucket the source broadcasts on group `name` and load it; returns its tensor count."""
        if self.image_model is not None:  # a VLM: the on-disk names SGLang's model loads
            names = [checkpoint_name(n) for n in names]
        result = self.engine.update_weights_from_distributed(
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=name,
            flush_cache=False,
            load_format="flattened_bucket",
        )
        _check(result, "update_weights_from_distributed")
        return len(names)

    def end_weight_group_update(self, name: str) -> None:
        """Close the weight-update session and flush the radix cache."""
        _check(self.engine.end_weight_update(), "end_weight_update")
        self.engine.flush_cache()

    def leave_weight_group(self, name: str) -> None:
        """Destroy the group `name` in SGLang's workers."""
        _check(self.engine.destroy_weights_update_group(group_name=name), "destroy_weights_update_group")

    def sleep(self) -> None:
        """Release GPU memory (no-op without `enable_memory_saver`)."""
        if self.memory_saver and not self._released:
            self.engine.release_memory_occupation(tags=None)
            self._released = {WEIGHTS, KV_CACHE, "cuda_graph"}

    def wake(self) -> None:
        """Resume what `sleep` released."""
        if self._released:
            self.engine.resume_memory_occupation(tags=sorted(self._released))
            self._released = set()

    def shutdown(self) -> None:
        """Stop SGLang's scheduler and detokenizer processes."""
        self.engine.shutdown()


def flattened_payloads(bucket: list[tuple[str, torch.Tensor]], tp_size: int) -> list[Any]:
    """One bucket as `update_weights_from_tensor(load_format="flattened_bucket")` takes it: its tensors flattened
    into one (`FlattenedTensorBucket`), serialised by `MultiprocessingSerializer` once per TP rank (each rank
    maps its own copy of the CUDA IPC handle, so the producer's reference counts drop after every load)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()  # the handle names the GPU by UUID: SGLang's ranks see other device indices
    flat = FlattenedTensorBucket(named_tensors=bucket)
    data = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    return [MultiprocessingSerializer.serialize(data, output_str=True) for _ in range(tp_size)]


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating weights in the engine's dtype (one dtype per flattened bucket); others as they are."""
    return tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach()


def engine_kwargs(
    model_path: str,
    dtype: str,
    tp_size: int,
    mem_fraction_static: float,
    enable_memory_saver: bool,
    max_model_len: int,
    seed: int,
    max_images: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine` (fields of SGLang's `ServerArgs`); `max_images` (a vision-language
    model's `data.max_images_per_prompt`) limits the images of a request."""
    out = {
        "model_path": model_path,
        "dtype": dtype,
        "tp_size": tp_size,
        "mem_fraction_static": mem_fraction_static,
        "enable_memory_saver": enable_memory_saver,
        "enable_weights_cpu_backup": enable_memory_saver,  # weights survive a release: wake alone suffices
        "context_length": max_model_len,
        "random_seed": seed,
        "log_level": "error",
    }
    if max_images is not None:
        out["limit_mm_data_per_request"] = {"image": max_images}
    return out


def image_data(prompt: ImagePrompt) -> list[dict[str, Any]] | None:
    """One request's `image_data` for `sglang.Engine.generate`: its images already processed (a `processor_output`
    dict of `pixel_values` and `image_grid_thw`, all the request's images in order), None without images."""
    if not prompt.inputs:
        return None
    return [{"format": "processor_output", **prompt.inputs}]


def _check(result: Any, what: str) -> None:
    """SGLang's weight calls answer (success, message) or an object with those fields: raise on failure."""
    if result is None:
        return
    success, message = (
        (result[0], result[1])
        if isinstance(result, tuple)
        else (
            getattr(result, "success", True),
            getattr(result, "message", ""),
        )
    )
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")
