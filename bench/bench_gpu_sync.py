"""Weights between trainer and rollout on one GPU (issue 29); each figure a ratio against a baseline of the same run:

- CUDA IPC push (`sync.cuda_ipc.FlatPusher`: the weights cast to bf16 into one persistent device buffer,
  shared once; a second process maps it once, then each push sends only its id and offsets and the receiver
  copies the tensors into its own weights) against an in-device cast-copy of the same bytes in one process, for
  the demo's model shape (SmolLM2-135M) and a 1.5B one (Qwen2-1.5B shape), random weights, after two warm-up
  pushes (the first learns the size, the second allocates and shares the buffer); the receiver stands in for
  the engine with one `_foreach_copy_` into weights of its own (vLLM's `load_weights` is the engine's cost, not
  the transport's); also, informative, against one `_foreach_copy_` in one process;
- vLLM rollout tokens/s against the HF rollout's on the same GPU (the demo's 8 prompts x 8 samples x 48 tokens);
- the hybrid step with vLLM: the share of generate, update, sync and sleep in one step (informative).

Without CUDA it records nothing and exits 0 (`make bench` on a CPU machine); without vLLM the vLLM figures are
skipped. `python -m bench gpu_sync`
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import MODEL_SHAPES, record, shape_fields

SHAPES = ("smollm2-135m", "qwen2-1.5b")  # the models (bench.common.MODEL_SHAPES) whose weights are pushed
BUCKET_BYTES = 512 * 2**20


def random_weights(shape: dict[str, Any], device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """An fp32 model of `shape` with random weights on `device`, as HF-named tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(shape)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)  # tie_word_embeddings as the real model
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return [(n, p.detach()) for n, p in model.named_parameters()]


def _receiver(conn: Any) -> None:
    """The engine's side: map each bucket, copy its tensors into weights of its own (allocated once)."""
    from rlstages.engines.sync import cuda_ipc

    own: dict[str, torch.Tensor] = {}

    def load(named: list[tuple[str, torch.Tensor]]) -> None:  # the engine's own copy, one multi-tensor call
        for name, tensor in named:
            if name not in own:
                own[name] = torch.empty_like(tensor)
        torch._foreach_copy_([own[name] for name, _ in named], [tensor for _, tensor in named])

    while (message := conn.recv()) is not None:
        conn.send(cuda_ipc.receive(message, load))


def sync_figures(device: torch.device) -> None:
    """CUDA IPC push into a second process vs an in-device copy (cast to bf16) of the same weights."""
    from rlstages.engines.sync import cuda_ipc
    from rlstages.engines.sync.buckets import tensor_buckets

    ctx = mp.get_context("spawn")
    for label in SHAPES:
        shape = MODEL_SHAPES[label]
        weights = random_weights(shape, device)
        targets = {n: torch.empty_like(t, dtype=torch.bfloat16) for n, t in weights}
        here, there = ctx.Pipe()
        child = ctx.Process(target=_receiver, args=(there,), daemon=True)
        child.start()

        def send(message: dict[str, Any], here: Any = here) -> int:
            here.send(message)
            return int(here.recv())

        pusher = cuda_ipc.FlatPusher(torch.bfloat16, device)
        messages: list[float] = []

        def push(weights: list = weights, send: Any = send, pusher: Any = pusher, messages: list = messages) -> float:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            metrics = pusher.push(tensor_buckets(iter(weights), BUCKET_BYTES), send)
            messages.append(metrics["sync/messages"])
            return time.perf_counter() - start

        def copy(weights: list = weights, targets: dict = targets) -> float:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for name, tensor in weights:
                targets[name].copy_(tensor)
            torch.cuda.synchronize(device)
            return time.perf_counter() - start

        def fused_copy(weights: list = weights, targets: dict = targets) -> float:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            torch._foreach_copy_([targets[name] for name, _ in weights], [tensor for _, tensor in weights])
            torch.cuda.synchronize(device)
            return time.perf_counter() - start

        push(), push(), copy(), fused_copy()  # warm-up: the buffer's size learnt, then allocated and mapped
        ours = sorted(push() for _ in range(5))[2]
        base = sorted(copy() for _ in range(5))[2]
        fused = sorted(fused_copy() for _ in range(5))[2]
        assert messages[2:] == [1.0] * 5, messages  # timed pushes: one buffer, one message each
        pusher_bytes = pusher.capacity
        pusher.release(send)
        here.send(None)
        child.join(60)
        params = sum(t.numel() for _, t in weights) / 1e9
        record(
            f"gpu_sync/cuda_ipc_push_vs_device_copy[{label}]",
            ours / base,
            "<= 2.0",
            f"{params:.2f}B params, bf16 into one persistent buffer ({pusher_bytes / 2**20:.0f} MiB, shared once) "
            f"read by a second process: {ours * 1e3:.1f} ms; in-device cast-copy {base * 1e3:.1f} ms "
            f"({torch.cuda.get_device_name(device)})",
        )
        record(
            f"gpu_sync/cuda_ipc_push_vs_fused_device_copy[{label}]",
            ours / fused,
            None,
            f"the same push against one `_foreach_copy_` of the same bytes in one process: {fused * 1e3:.1f} ms "
            "(the fastest in-process copy: what a push could cost with no transport at all)",
        )
        del weights, targets
        torch.cuda.empty_cache()


def vllm_figures(device: torch.device) -> None:
    """vLLM tokens/s vs the HF rollout's on the demo's shape, and the hybrid step's time split with vLLM."""
    from rlstages.engines import algorithms as A
    from rlstages.engines import types as T
    from rlstages.engines.models import build_tiny_model
    from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
    from rlstages.engines.rollout.vllm_rollout import VLLMRolloutEngine
    from rlstages.engines.training.settings import TrainerSettings
    from rlstages.engines.types import Prompt, SamplingParams
    from rlstages.engines.workers.hybrid import HybridEngine

    shape = shape_fields("smollm2-135m", "vocab_size")
    path = build_tiny_model(Path(tempfile.mkdtemp(prefix="rlstages-gpu-demo-")), "llama", vocab_size=512, **shape)
    prompts = [Prompt(f"u{i}", f"{i}+{i + 3}=", str(2 * i + 3)) for i in range(8)]
    sampling = SamplingParams(n=8, temperature=0.7, max_new_tokens=48)

    def tokens_per_s(engine: Any) -> float:
        engine.generate(prompts, sampling, 0)  # warm-up
        start = time.perf_counter()
        batch = engine.generate(prompts, sampling, 1)
        return float(batch[T.RESPONSE_MASK].sum()) / (time.perf_counter() - start)

    vllm = VLLMRolloutEngine(
        str(path), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=256, apply_chat_template=False
    )
    ours = tokens_per_s(vllm)
    vllm.shutdown()
    del vllm
    torch.cuda.empty_cache()
    hf = HFRolloutEngine(path, dtype="bfloat16", apply_chat_template=False, attention="sdpa")
    base = tokens_per_s(hf)
    del hf
    torch.cuda.empty_cache()
    record("gpu_rollout/vllm_vs_hf_tokens_per_s", ours / base, ">= 1.0", f"vLLM {ours:.0f} tok/s, HF {base:.0f} tok/s")

    engine = HybridEngine(
        "rlstages.engines.training.core:PPOTrainer",
        {"settings": TrainerSettings(str(path), dtype="bfloat16")},
        "rlstages.engines.rollout.vllm_rollout:VLLMRolloutEngine",
        {
            "model_path": str(path),
            "dtype": "bfloat16",
            "gpu_memory_utilization": 0.3,
            "max_model_len": 256,
            "apply_chat_template": False,
        },
    )
    phases: dict[str, float] = {"generate": 0.0, "sleep": 0.0, "update": 0.0, "sync": 0.0}
    for step in range(4):
        t0 = time.perf_counter()
        batch = engine.generate(prompts, sampling, step)
        t1 = time.perf_counter()
        engine.sleep()
        t2 = time.perf_counter()
        token = A.outcome_to_token_rewards(torch.rand(batch.batch_size[0]), batch[T.RESPONSE_MASK])
        batch[T.ADVANTAGES], batch[T.RETURNS] = A.compute_advantages(
            "grpo", token, batch[T.RESPONSE_MASK], T.get_rows(batch, "uid")
        )
        engine.train_step(batch)
        t3 = time.perf_counter()
        engine.sync_local()
        t4 = time.perf_counter()
        if step:  # the first step warms up
            for key, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                phases[key] += dt
    engine.rollout.shutdown()
    total = sum(phases.values())
    for key, seconds in phases.items():
        record(
            f"gpu_hybrid/{key}_share_of_step",
            seconds / total,
            None,
            f"{seconds / 3 * 1e3:.0f} ms of a {total / 3 * 1e3:.0f} ms step (vLLM hybrid, demo shape, 3 steps)",
        )


def main() -> None:
    """The GPU figures, or nothing without CUDA."""
    if not torch.cuda.is_available():
        print("bench_gpu_sync: no CUDA device here; nothing measured")
        return
    device = torch.device("cuda", torch.cuda.current_device())
    sync_figures(device)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("bench_gpu_sync: vLLM (CUDA build) not installed; its figures skipped", file=sys.stderr)
        return
    vllm_figures(device)


if __name__ == "__main__":
    main()
