"""Shared fixtures: an isolated environment, a tiny model built from a config, one local Ray and one
Prefect test harness per session. Runs on a CPU; `make test` runs everything CI runs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_SESSION_TMP = Path(tempfile.mkdtemp(prefix="rlstages-tests-"))
os.environ.setdefault("PREFECT_HOME", str(_SESSION_TMP / "prefect"))
for key, value in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "OMP_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "MLFLOW_ENABLE_ASYNC_LOGGING": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}.items():
    os.environ.setdefault(key, value)

import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def session_tmp() -> Path:
    """A temporary directory shared by the whole session."""
    return _SESSION_TMP


@pytest.fixture(scope="session")
def tiny_model_dir(session_tmp: Path) -> Path:
    """A random-init Qwen2 (hidden 64, 2 layers, GQA 4/2, QKV bias) with a char tokenizer, saved once."""
    from rlstages.engines.models import build_tiny_model

    path = session_tmp / "tiny-qwen2"
    if not (path / "config.json").is_file():
        build_tiny_model(path)
    return path


TINY_MOE = {  # a tiny Qwen3-MoE: hidden 32, 2 layers, 4 routed experts (top-2), every layer MoE
    "model_type": "qwen3_moe",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


@pytest.fixture(scope="session")
def tiny_moe_dir(session_tmp: Path) -> Path:
    """A random-init Qwen3-MoE (`TINY_MOE`) with a char tokenizer, saved once (one tensor per expert)."""
    from rlstages.engines.models import build_tiny_model

    path = session_tmp / "tiny-qwen3-moe"
    if not (path / "config.json").is_file():
        build_tiny_model(path, **TINY_MOE)  # type: ignore[arg-type]
    return path


@pytest.fixture(scope="session")
def tiny_deepseek_dir(session_tmp: Path) -> Path:
    """A random-init DeepSeek-V3 (hidden 32, 3 layers: the dense first one, then two with 4 routed experts (top-2)
    and a shared expert; Multi-head Latent Attention) with a char tokenizer, saved once."""
    from rlstages.engines.models import build_tiny_model

    path = session_tmp / "tiny-deepseek-v3"
    if not (path / "config.json").is_file():
        build_tiny_model(path, **{**TINY_MOE, "model_type": "deepseek_v3", "num_hidden_layers": 3})  # type: ignore[arg-type]
    return path


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the session (2 CPUs, no dashboard; token auth on, 127.0.0.1 only)."""
    import ray

    from rlstages.tasks.ray_auth import init_local_ray

    if not ray.is_initialized():
        init_local_ray(num_cpus=2, include_dashboard=False, namespace="rlstages-tests", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def prefect_harness():
    """Real Prefect with no server: one temporary SQLite-backed API for the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
