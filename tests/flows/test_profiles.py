"""Stage profiles (`trainer.profile`): a tiny run with the engines in the driver (`cluster.mode=in_process`)
profiles update_actor and generate at step 1; their Chrome traces load from MLflow as JSON with the stage's own
events (the optimizer step in update_actor, none in generate), with the top-ops table and peak RSS beside them,
and a Prefect markdown artifact links them. Real Prefect and MLflow."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow import MlflowClient
from session_cache import mlflow_store

from rlstages.configs import config_hash, load_config
from rlstages.flows.train import rl_post_train

ROOT = Path(__file__).resolve().parents[2]


def _trace_names(client: MlflowClient, run_id: str, path: str, into: Path) -> set[str]:
    local = client.download_artifacts(run_id, path, str(into))
    events = json.loads(Path(local).read_text())["traceEvents"]
    return {e.get("name", "") for e in events}


def test_profiled_stages_leave_traces_in_mlflow(tmp_path: Path, tiny_model_dir: Path, prefect_harness) -> None:
    overrides = [
        f"model.path={tiny_model_dir}",
        "model.provider=local",
        "cluster.mode=in_process",
        "trainer.total_steps=1",
        "trainer.eval_at_start=false",
        "trainer.eval_every=0",
        f"trainer.output_dir={tmp_path / 'runs'}",
        "trainer.run_name=profiled",
        f"tracking.tracking_uri={mlflow_store(tmp_path)}",
        "tracking.log_model=false",
        "trainer.profile={steps: [1], stages: [update_actor, generate], record_shapes: true}",
    ]
    cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides)
    assert config_hash(cfg) == config_hash(load_config(ROOT / "configs" / "tiny.yaml", overrides[:-1]))
    rl_post_train(cfg)
    client = MlflowClient(cfg.tracking.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    listed = {a.path for a in client.list_artifacts(run.info.run_id, "profiles/step_1/update_actor/actor-0")}
    assert {
        f"profiles/step_1/update_actor/actor-0/{n}" for n in ("trace.json", "top_ops.txt", "peak_rss.json")
    } <= listed
    update = _trace_names(client, run.info.run_id, "profiles/step_1/update_actor/actor-0/trace.json", tmp_path / "u")
    generate = _trace_names(client, run.info.run_id, "profiles/step_1/generate/rollout-0/trace.json", tmp_path / "g")
    assert any(n.startswith("Optimizer.step") for n in update) and any(n.startswith("aten::") for n in generate)
    assert not any(n.startswith("Optimizer.step") for n in generate)
    rss_file = client.download_artifacts(run.info.run_id, "profiles/step_1/update_actor/actor-0/peak_rss.json")
    rss = json.loads(Path(rss_file).read_text())
    assert rss["peak_rss_bytes"] > 0
    # the engine's tensors after the update: the weights and AdamW's two moments (fp32, as the checkpoint file)
    assert rss["engine_tensor_bytes"] >= 2.9 * (tiny_model_dir / "model.safetensors").stat().st_size
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as prefect:
        key = ArtifactFilterKey(any_=["profile-step-1-update-actor"])
        (artifact,) = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=key), limit=1)
    assert "profiles/step_1/update_actor/actor-0/trace.json" in str(artifact.data) and run.info.run_id in str(
        artifact.data
    )
    assert not (Path(cfg.trainer.output_dir) / "profiled" / "profiles" / "step_1" / "actor_logprobs").exists()
