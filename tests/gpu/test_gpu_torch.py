"""The torch backend and the HF rollout on CUDA: placement (parameters, gradients and optimizer states on the
worker's GPU), a GRPO step equal to the CPU step, greedy decoding equal to `model.generate`, GPU metrics.
Marked `gpu`: run with `scripts/gpu_check.sh` (or `pytest -m gpu tests/gpu`) on a machine with CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_helpers import PROMPTS, masked_max

from rlstages.engines import types as T
from rlstages.engines.runtime.device import worker_device
from rlstages.engines.training.core import PPOTrainer
from rlstages.engines.training.flops import peak_flops
from rlstages.engines.types import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_worker_device_is_the_current_cuda_device() -> None:
    device = worker_device()  # outside Ray: GPU 0 (in a Ray actor: the one Ray assigned, see test_device.py)
    assert device == torch.device("cuda", 0) and torch.cuda.current_device() == 0


def test_parameters_gradients_and_optimizer_state_on_the_gpu(tiny_model_dir: Path, batch, settings) -> None:
    engine = PPOTrainer(settings(tiny_model_dir, dtype="bfloat16"))
    model, optimizer = engine.backend.model, engine.backend.optimizer
    assert all(p.device == torch.device("cuda", 0) for p in model.parameters())
    grads: list[torch.device] = []
    hooks = [p.register_hook(lambda g: grads.append(g.device)) for p in model.parameters()]
    metrics = engine.train_step(batch)
    for h in hooks:
        h.remove()
    assert grads and all(d.type == "cuda" for d in grads)
    states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    assert states and all(t.is_cuda for t in states)
    assert metrics["perf/max_memory_allocated_gb"] > 0 and metrics["perf/memory_used_gb"] > 0
    assert metrics["perf/max_memory_reserved_gb"] >= metrics["perf/max_memory_allocated_gb"]
    assert metrics["perf/throughput"] > 0
    known = peak_flops(torch.cuda.get_device_name(0)) is not None
    assert ("perf/mfu" in metrics) == known and (not known or 0 < metrics["perf/mfu"] < 1)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_grpo_step_on_cuda_equals_the_cpu_step(tiny_model_dir: Path, batch, settings, autocast, monkeypatch) -> None:
    tol = 3e-2 if autocast else 1e-4
    gpu = PPOTrainer(settings(tiny_model_dir, bf16_autocast=autocast, share_prompt_forward=True))
    with monkeypatch.context() as mp:
        mp.setenv("RLSTAGES_DEVICE", "cpu")
        cpu = PPOTrainer(settings(tiny_model_dir, bf16_autocast=autocast, share_prompt_forward=True))
    assert next(cpu.backend.model.parameters()).device.type == "cpu"
    mask = batch[T.RESPONSE_MASK]
    lp_gpu, lp_cpu = gpu.logprobs(batch), cpu.logprobs(batch)
    assert lp_gpu["logprobs"].device.type == "cpu"  # results leave the worker on the host
    assert masked_max(lp_gpu["logprobs"], lp_cpu["logprobs"], mask) <= tol
    m_gpu, m_cpu = gpu.train_step(batch), cpu.train_step(batch)
    for key in ("pg_loss", "entropy", "grad_norm"):
        assert m_gpu[key] == pytest.approx(m_cpu[key], rel=tol, abs=tol)
    after_gpu, after_cpu = gpu.logprobs(batch), cpu.logprobs(batch)
    assert masked_max(after_gpu["logprobs"], after_cpu["logprobs"], mask) <= tol
    assert masked_max(after_gpu["logprobs"], lp_gpu["logprobs"], mask) > 0  # the step changed the policy


def test_hf_rollout_greedy_tokens_equal_generate(tiny_model_dir: Path) -> None:
    from rlstages.engines.rollout.batching import format_prompts
    from rlstages.engines.rollout.hf_rollout import HFRolloutEngine

    engine = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False, attention="sdpa")
    assert next(engine.model.parameters()).is_cuda
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=12), seed=0)
    rows = [ids for ids in format_prompts(engine.tokenizer, PROMPTS, False, None) for _ in range(2)]
    enc = engine.tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt").to("cuda")
    eos = sorted(engine.eos_ids)
    ref = engine.model.generate(**enc, do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=eos[0])
    ref = ref[:, enc["input_ids"].shape[1] :].cpu()
    for row, n in enumerate(out[T.RESPONSE_MASK].sum(-1).long().tolist()):
        assert out[T.RESPONSE_IDS][row, :n].tolist() == ref[row, :n].tolist()
    assert out[T.ROLLOUT_LOGPROBS].device.type == "cpu"


def test_profiled_train_step_leaves_a_cuda_memory_snapshot(tiny_model_dir: Path, batch, settings) -> None:
    """trainer.profile's memory path on CUDA (engines/runtime/profiling.py): `_record_memory_history` ->
    `_dump_snapshot` around a train step gives a snapshot PyTorch's memory viz reads (segments and the step's
    allocation events) and the peak the trainer reports."""
    import json
    import pickle

    from rlstages.engines.runtime import profiling

    engine = PPOTrainer(settings(tiny_model_dir, dtype="bfloat16"))
    assert profiling.start(engine, profiling.ProfileOptions(memory=True))
    engine.train_step(batch)
    files = profiling.stop(engine)
    snapshot = pickle.loads(files["memory_snapshot.pickle"])
    assert snapshot["segments"] and sum(len(t) for t in snapshot["device_traces"]) > 0
    memory = json.loads(files["peak_rss.json"])
    assert memory["cuda_max_memory_allocated"] > 0 and "CUDA" in files["top_ops.txt"].decode()
