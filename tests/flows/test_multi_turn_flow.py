"""A 2-step GRPO flow with multi-turn rollouts and the calculator tool, on a tiny random model with real
Prefect, Ray and MLflow: every step logs the tool and trajectory metrics and a decoded trajectory table,
and evaluation logs the tool-call rate; split placement.
CPU only: `pytest tests/flows/test_multi_turn_flow.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient
from session_cache import mlflow_store

from rlstages.configs import load_config
from rlstages.flows.train import rl_post_train

ROOT = Path(__file__).resolve().parents[2]
TINY_CHAT = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
STEP_METRICS = (
    "tools/call_frequency",
    "tools/failure_rate",
    "tools/latency_p95_s",
    "tools/truncation_rate",
    "rollout/turns_mean",
    "rollout/masked_token_fraction",
    "rollout/stop_done",
    "rollout/stop_length",
    "rollout/stop_max_turns",
    "rollout/stop_context",
    "rollout/stop_error",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen2 with a 2048-token window (the calculator's schema is ~300 char tokens)."""
    from rlstages.engines.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("mt-model") / "model", max_position_embeddings=2048)


def test_two_grpo_steps_with_the_calculator_log_the_multi_turn_metrics(
    tmp_path: Path, model_dir: Path, ray_session, prefect_harness
) -> None:
    """Split placement (rollout and trainer in separate workers, weights synced every step; the hybrid engine
    runs in the agentic_multiply preset), with the assistant prefill, the format reward and token-level
    rollout IS correction from the stored log-probs."""
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"model.path={model_dir}",
            "model.provider=local",
            f"trainer.output_dir={tmp_path / 'runs'}",
            "trainer.run_name=mt",
            f"tracking.tracking_uri={mlflow_store(tmp_path)}",
            "tracking.log_model=false",
            "checkpoint.every=0",
            "data.apply_chat_template=true",
            "data.chat_template=" + TINY_CHAT.replace("'", "''").join("''"),
            "rollout.multi_turn.enabled=true",
            "rollout.multi_turn.max_turns=2",
            "rollout.multi_turn.per_turn_max_tokens=8",
            "rollout.multi_turn.max_response_tokens=24",
            "rollout.multi_turn.environment={tools: [{name: calculator}]}",
            "cluster.hybrid_engine=false",
            "algorithm.rollout_is.level=token",
            "rollout.multi_turn.assistant_prefill=<tool_call>",
            "reward.functions=[{name: digit_ratio}, {name: tool_call_format, weight: 0.1}]",
        ],
    )
    assert not cfg.cluster.hybrid_engine and cfg.cluster.mode == "ray"
    rl_post_train(cfg)
    client = MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([exp.experiment_id], filter_string="attributes.run_name = 'mt'")
    assert run.info.status == "FINISHED"
    for key in STEP_METRICS:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert steps == [1, 2], f"{key} logged at steps {steps}"
    trajectories = cfg.data.prompts_per_step * cfg.rollout.n
    for step in (1, 2):
        stops = sum(
            client.get_metric_history(run.info.run_id, f"rollout/stop_{r}")[step - 1].value
            for r in ("done", "length", "max_turns", "context", "error")
        )
        assert stops == trajectories
    assert "eval/tools_call_frequency" in run.data.metrics
    path = client.download_artifacts(run.info.run_id, "rollout/trajectories_step_000002.json", str(tmp_path))
    table = json.loads(Path(path).read_text())
    rows = [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]
    assert rows and all(r["trajectory"].startswith("[prompt]") and "[policy]" in r["trajectory"] for r in rows)
    assert all("[/prompt][prefill]<tool_call>[/prefill][policy]" in r["trajectory"] for r in rows)
    for key in ("reward/tool_call_format/mean", "rollout_corr/is_ratio_mean"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2], key
