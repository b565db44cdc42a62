"""The training flow with a tiny Qwen3-MoE on the Megatron-Core backend at EP=2 (2 ranks; experts split 2 + 2,
the dense part data-parallel), HF rollout synced from Megatron's per-expert export every step: 2 steps, the
`moe/*` metrics in MLflow as actor metrics. CPU only; skipped without megatron-core."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from test_backend_flows import assert_trained, run_two_steps

MOE = [
    "model.tiny.model_type=qwen3_moe",
    "model.tiny.num_experts=4",
    "model.tiny.num_experts_per_tok=2",
    "model.tiny.moe_intermediate_size=32",
    "model.tiny.num_attention_heads=4",
    "model.tiny.num_key_value_heads=2",
]


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs `pip install .[megatron]`")
def test_flow_with_megatron_moe_at_ep2(tmp_path: Path, ray_session, prefect_harness) -> None:
    overrides = ["actor.backend=megatron", "actor.num_workers=2", "actor.expert_model_parallel_size=2"]
    client, run = run_two_steps(tmp_path, "moe-ep2", *MOE, *overrides, "actor.moe.aux_loss_coeff=0.001")
    assert_trained(client, run)
    assert max(m.value for m in client.get_metric_history(run.info.run_id, "rollout/logprob_diff")) < 1e-4
    for key in ("actor/moe/tokens_per_expert_imbalance", "actor/moe/aux_loss"):
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [1, 2] and all(m.value >= 0.5 for m in history), key
    assert (tmp_path / "runs" / "moe-ep2" / "checkpoints" / "step_000002").is_dir()
