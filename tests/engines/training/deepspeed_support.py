"""What the DeepSpeed trainer tests share (tests/engines/training/test_deepspeed_trainer.py, test_deepspeed_vlm.py): the
extensions directory and process-group environment, one world-1 gloo group per module (`one_process_group`), the
settings of a DeepSpeed or torch engine, and `rank_weights` that runs inside a Ray rank. Test files ship this module
to Ray workers by value (`ship_to_ray`): they cannot import it."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.utils.cpp_extension import get_default_build_root

from rlstages.configs.training import DeepSpeedTrainingConfig, OptimConfig, TorchTrainingConfig
from rlstages.engines.training.core import PPOTrainer
from rlstages.engines.training.settings import TrainerSettings

# torch's default root, one folder per venv (given to the Ray workers alike): torch's own `pyXY_cpu` is shared by
# every venv of the machine, and ninja rebuilds an op (cpu_adam: ~80 s on two cores) whenever another venv, whose
# include paths differ, built it last
EXT_DIR = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
    Path(get_default_build_root())
    / f"py{sys.version_info.major}{sys.version_info.minor}_cpu-{hashlib.sha1(sys.prefix.encode()).hexdigest()[:8]}"
)
OPTIM = OptimConfig(lr=1e-2, total_steps=10, schedule="cosine")
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR")


def ship_to_ray(module: ModuleType) -> None:
    """Ship a test module's helper functions, and this module's, to Ray workers by value (test files are not
    importable there)."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(module)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module", autouse=True)
def one_process_group() -> Iterator[None]:
    """Every in-process engine here shares one world-1 gloo group; the env and group are undone afterwards."""
    saved = {k: os.environ.get(k) for k in DIST_ENV}
    os.environ["TORCH_EXTENSIONS_DIR"] = EXT_DIR
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def settings(
    path: Path, backend: str, role: str = "actor", dtype: str = "float32", num_mini_batches: int = 1, **options
) -> TrainerSettings:
    """Settings of a `backend` engine; `options` are its training config's fields (4 rows per micro-batch)."""
    options.setdefault("micro_batch_size", 4)
    config = DeepSpeedTrainingConfig if backend == "deepspeed" else TorchTrainingConfig
    train = config(optim=OPTIM, **options)
    return TrainerSettings(str(path), role=role, train=train, dtype=dtype, num_mini_batches=num_mini_batches)  # type: ignore[arg-type]


def ds(path: Path, **kw) -> PPOTrainer:
    return PPOTrainer(settings(path, "deepspeed", **kw))


def torch_engine(path: Path, **kw) -> PPOTrainer:
    return PPOTrainer(settings(path, "torch", **kw))


def snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.named_weights()}


def rank_weights(engine: PPOTrainer) -> dict[str, torch.Tensor]:
    """Runs inside each rank (`__ray_call__`): its full weights (a collective under ZeRO-3)."""
    return {k: v.clone() for k, v in engine.named_weights()}
