"""`engines/runtime/device.py`: which device a worker computes on (Ray's assignment, narrowed or not, the
override), the distributed backend and env that follow from it, and the CPU path of its helpers; and
`engines/training/flops.py`: the FLOP count of a known config by hand, and no MFU for an unknown device.
CPU only: the resolution logic is a pure function of the environment, checked here without a GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlstages.engines.runtime import device as D
from rlstages.engines.training import flops as F

GPU4 = {"cuda_available": True, "device_count": 4}


def test_cpu_without_cuda_whatever_ray_assigned() -> None:
    assert D.resolve_device({}, False, 0, None) == torch.device("cpu")
    assert D.resolve_device({"CUDA_VISIBLE_DEVICES": "0"}, False, 0, ["0"]) == torch.device("cpu")


def test_outside_ray_the_first_gpu() -> None:
    assert D.resolve_device({}, **GPU4, ray_gpu_ids=None) == torch.device("cuda", 0)


def test_an_actor_without_a_gpu_computes_on_the_cpu_on_a_gpu_node() -> None:
    assert D.resolve_device({}, **GPU4, ray_gpu_ids=[]) == torch.device("cpu")


def test_ray_narrowed_visibility_makes_the_assigned_gpu_cuda_0() -> None:
    narrowed = {"CUDA_VISIBLE_DEVICES": "3"}
    assert D.resolve_device(narrowed, True, 1, ["3"]) == torch.device("cuda", 0)


def test_noset_visibility_takes_the_assigned_id_among_the_visible_ones() -> None:
    noset = {D.NOSET_ENV: "1"}
    assert D.resolve_device(noset, **GPU4, ray_gpu_ids=[2]) == torch.device("cuda", 2)
    some = {D.NOSET_ENV: "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert D.resolve_device(some, **GPU4, ray_gpu_ids=["6"]) == torch.device("cuda", 2)


def test_fractional_gpus_share_the_device() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "1"}  # two colocated actors of 0.5 GPU each were both given GPU 1
    assert D.resolve_device(env, True, 1, ["1"]) == D.resolve_device(env, True, 1, ["1"]) == torch.device("cuda", 0)


def test_an_assigned_gpu_that_is_not_visible_is_an_error_naming_both() -> None:
    with pytest.raises(RuntimeError, match="Ray assigned GPU 2 but CUDA_VISIBLE_DEVICES=0,1"):
        D.resolve_device({"CUDA_VISIBLE_DEVICES": "0,1"}, True, 2, [2])
    with pytest.raises(RuntimeError, match="only 2 CUDA devices"):
        D.resolve_device({}, True, 2, [5])


def test_the_override_wins_and_refuses_cuda_without_it() -> None:
    assert D.resolve_device({D.DEVICE_ENV: "cpu"}, **GPU4, ray_gpu_ids=["0"]) == torch.device("cpu")
    assert D.resolve_device({D.DEVICE_ENV: "cuda:1"}, **GPU4, ray_gpu_ids=None) == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="RLSTAGES_DEVICE=cuda but CUDA is not available"):
        D.resolve_device({D.DEVICE_ENV: "cuda"}, False, 0, None)


def test_this_worker_is_on_the_cpu_and_the_helpers_are_no_ops_there() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    cpu = D.worker_device()
    assert cpu == torch.device("cpu")
    batch = TensorDict({"ids": torch.ones(2, 3)}, batch_size=[2])
    assert D.to_device(batch, cpu) is batch and D.to_host(batch) is batch
    moved = D.to_device({"a": [torch.zeros(1)], "b": 3}, torch.device("meta"))
    assert moved["a"][0].device.type == "meta" and moved["b"] == 3
    assert D.device_memory_stats(cpu) == {} and D.device_name(cpu) == "cpu"
    D.free_cached(cpu), D.reset_peak_memory(cpu), D.synchronize(cpu)


def test_on_cuda_follows_the_worker_not_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """`on_cuda` is the worker's device (the override, Ray's assignment), the question megatron's shims ask."""
    assert D.on_cuda(torch.device("cuda", 1)) and not D.on_cuda(torch.device("cpu"))
    monkeypatch.setenv(D.DEVICE_ENV, "cpu")
    assert not D.on_cuda(D.worker_device())  # a worker pinned to the CPU, even where CUDA exists


def test_the_device_is_decided_in_one_place() -> None:
    """Only engines/runtime/device.py asks torch whether CUDA exists; everything else in engines/ and tasks/
    tests the device it was given (`device.type`) or asks `runtime.device` (issue #43)."""
    root = Path(__file__).resolve().parents[3]
    askers = sorted(
        str(f.relative_to(root))
        for pkg in ("engines", "tasks")
        for f in (root / pkg).rglob("*.py")
        if "cuda.is_available" in f.read_text()
    )
    assert askers == ["engines/runtime/device.py"]


def test_the_backend_is_given_the_trainers_device(tiny_model_dir: Path) -> None:
    """PPOTrainer resolves the device once and passes it down in the backend's settings."""
    from rlstages.engines.training.core import PPOTrainer
    from rlstages.engines.training.settings import TrainerSettings

    trainer = PPOTrainer(TrainerSettings(str(tiny_model_dir), role="reference"))
    assert trainer.backend.settings.device == str(trainer.device)
    assert trainer.backend.device == trainer.device == D.worker_device()
    assert TrainerSettings("m", device="meta").resolved_device() == torch.device("meta")
    with pytest.raises(ValueError, match="a step backend is built by PPOTrainer"):
        TrainerSettings("m").resolved_device()  # never looked up again below the worker's start
    handed = PPOTrainer(TrainerSettings(str(tiny_model_dir), role="reference"), device=torch.device("cpu"))
    assert handed.backend.device == torch.device("cpu")  # a hybrid worker's device, passed down


# Where a worker starts: the engine an actor is built around (its constructor resolves the device unless handed
# one), and megatron-core's set-up in a process that holds no engine (conversion and parity workers).
WORKER_STARTS = {
    ("engines/training/core.py", "PPOTrainer.__init__"),
    ("engines/rollout/hf_rollout.py", "HFRolloutEngine.__init__"),
    ("engines/rollout/vllm_rollout.py", "VLLMRolloutEngine.__init__"),
    ("engines/rollout/sglang_rollout.py", "SGLangRolloutEngine.__init__"),
    ("engines/rewards/reward_model.py", "RewardModelEngine.__init__"),
    ("engines/workers/hybrid.py", "HybridEngine.__init__"),
    ("engines/megatron/gpt.py", "init_model_parallel"),
}


def device_lookups(path: Path, root: Path) -> list[tuple[str, str, str]]:
    """(file, enclosing function, call) of each `worker_device()` / `local_device()` / argument-less `on_cuda()`."""
    import ast

    found: list[tuple[str, str, str]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope + [child.name] if isinstance(child, ast.FunctionDef | ast.ClassDef) else scope
            if isinstance(child, ast.Call):
                name = getattr(child.func, "attr", getattr(child.func, "id", ""))
                if name in ("worker_device", "local_device") or (name == "on_cuda" and not child.args):
                    found.append((str(path.relative_to(root)), ".".join(scope), name))
            visit(child, inner)

    visit(ast.parse(path.read_text()), [])
    return found


def test_the_device_is_resolved_only_where_a_worker_starts() -> None:
    """`worker_device()` only where a worker starts (`WORKER_STARTS`), every engine below is handed the device;
    `on_cuda` always asks about a device it was given; the driver's `local_device` only for machine reports."""
    root = Path(__file__).resolve().parents[3]
    calls = [
        c for pkg in ("engines", "tasks", "flows") for f in (root / pkg).rglob("*.py") for c in device_lookups(f, root)
    ]
    calls = [c for c in calls if c[0] != "engines/runtime/device.py"]
    assert {(f, fn) for f, fn, name in calls if name == "worker_device"} == WORKER_STARTS
    assert [c for c in calls if c[2] == "on_cuda"] == []
    assert [(f, fn) for f, fn, name in calls if name == "local_device"] == [
        ("engines/training/machine.py", "gemm_choice")
    ]


def test_visible_gpus_falls_back_to_nvidia_smi_within_visible_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU-only torch beside a GPU driver: the driver's count comes from `nvidia-smi -L`."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA H100 (UUID: GPU-b)'\n")
    smi.chmod(0o755)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert D.visible_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert D.visible_gpus() == 1


def test_distributed_backend_and_gpu_env() -> None:
    assert D.dist_backend(torch.device("cpu")) == "gloo"
    assert D.dist_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert D.dist_backend(torch.device("cuda", 0), cpu_collectives=False) == "nccl"
    assert D.gpu_env() == {}
    assert D.gpu_env(False, 1) == {"NCCL_CUMEM_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def test_env_defaults_keep_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(D.MAX_CONNECTIONS_ENV, "8")
    monkeypatch.delenv(D.NCCL_CUMEM_ENV, raising=False)
    D.set_env_defaults({D.MAX_CONNECTIONS_ENV: "1", D.NCCL_CUMEM_ENV: "0"})
    import os

    assert os.environ[D.MAX_CONNECTIONS_ENV] == "8" and os.environ[D.NCCL_CUMEM_ENV] == "0"


# A GQA config small enough to count by hand: h=64, i=128, L=2, 4 heads of 16, 2 KV heads, V=100.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}


def test_flop_count_of_a_known_config_by_hand() -> None:
    # per layer: MLP 3*64*128 = 24576; q, o: 64*64 each; k, v: 64*32 each -> 64*(64+32+32+64) = 12288
    # N = 2*(24576 + 12288) + 2*100*64 = 73728 + 12800 = 86528
    assert F.dense_params(TINY) == 86528
    # sequences of 10 and 20 tokens, 2 epochs: 6*N*30 + 6*(100+400)*16*4*2 = 15575040 + 384000, times 2
    assert F.step_flops(TINY, [10, 20], passes=2) == 2 * (15_575_040 + 384_000)


def test_flop_count_matches_a_real_transformers_model_parameter_count() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**TINY, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2)  # no norms, no biases
    assert F.dense_params(config.to_dict()) == matmul


def test_mfu_only_for_a_known_device_in_low_precision() -> None:
    assert F.peak_flops("cpu") is None and F.peak_flops("NVIDIA Mystery GPU") is None
    assert F.mfu(1e15, 1.0, "cpu", True) is None
    assert F.mfu(1e15, 1.0, "NVIDIA Mystery GPU", True) is None
    assert F.mfu(989e12, 2.0, "NVIDIA H100 80GB HBM3", True) == pytest.approx(0.5)
    assert F.peak_flops("NVIDIA H100 PCIe") == 756e12 and F.peak_flops("NVIDIA H200") == 989e12
    assert F.mfu(989e12, 2.0, "NVIDIA H100 80GB HBM3", low_precision=False) is None  # fp32: not the bf16 peak
