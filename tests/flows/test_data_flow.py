"""A user's own data and model through the whole flow: a verl-format parquet file (chat-message prompts,
data_source, reward_model, extra_info) with a custom chat template and a prompt-length filter, and the
policy given as a hub id resolved offline from a temporary HF cache. Real Prefect and MLflow; the engines in
the driver (`cluster.mode=in_process`): data and models are the point here, not Ray."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient
from session_cache import mlflow_store

from rlstages.configs import load_config
from rlstages.flows.train import rl_post_train
from rlstages.tasks.driver.data.loading import data_record

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def test_verl_parquet_and_hub_model_id_run_and_are_recorded(
    tmp_path: Path, tiny_model_dir: Path, ray_session, prefect_harness, monkeypatch
) -> None:
    rows = [
        {
            "data_source": "openai/gsm8k" if i % 2 else "lighteval/MATH",
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"{i}+{i}=" * (1 + 9 * (i % 4 == 3))},
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(12)
    ]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    home = tmp_path / "hf"
    snapshot = home / "hub" / "models--tiny-org--tiny-qwen2" / "snapshots" / ("c" * 40)
    shutil.copytree(tiny_model_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("c" * 40)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            "model.path=tiny-org/tiny-qwen2",
            "model.provider=local",
            f"data.source={{kind: datasets, path: {data}}}",
            "data.apply_chat_template=true",
            "data.chat_template=" + TEMPLATE.replace("'", "''").join("''"),
            "data.max_prompt_length=40",
            "data.overlong_prompts=drop",
            "cluster.mode=in_process",
            "data.prompts_per_step=2",
            "data.eval_prompts=4",
            "reward.functions=[{name: by_data_source}, {name: digit_ratio}]",
            f"trainer.output_dir={tmp_path / 'runs'}",
            "trainer.run_name=verl",
            f"tracking.tracking_uri={mlflow_store(tmp_path)}",
            "tracking.log_model=false",
            "evaluation.k=4",
            "evaluation.greedy=true",
        ],
    )
    assert cfg.data.chat_template == TEMPLATE
    rl_post_train(cfg)
    client = MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/by_data_source/mean")] == [1, 2]
    assert client.get_metric_history(run.info.run_id, "reward/failures")[-1].value == 0.0
    # prompts 3, 7, 11 (ten times longer) exceed 40 tokens: dropped, counted and logged
    dropped = client.get_metric_history(run.info.run_id, "data/train_dropped_prompts")
    assert [m.value for m in dropped] == [3.0]
    record = data_record(cfg)
    inputs = {d.dataset.digest: d for d in client.get_run(run.info.run_id).inputs.dataset_inputs}
    assert record["train"]["digest"] in inputs and str(data) in inputs[record["train"]["digest"]].dataset.source
    samples = client.list_artifacts(run.info.run_id, "eval")
    assert samples, "eval samples were logged"
    # evaluation: greedy accuracy, mean@4 and pass@1/2/4, overall and per data source, at every evaluation
    latest = client.get_run(run.info.run_id).data.metrics
    for source in ("", "openai/gsm8k/", "lighteval/MATH/"):
        for name in ("greedy_accuracy", "mean_at_4", "pass_at_1", "pass_at_2", "pass_at_4"):
            assert f"eval/{source}{name}" in latest, f"eval/{source}{name}"
    histories = [client.get_metric_history(run.info.run_id, f"eval/pass_at_{j}") for j in (1, 2, 4)]
    assert len({len(h) for h in histories}) == 1 and len(histories[0]) == 3  # steps 0, 1, 2
    for p1, p2, p4 in zip(*([m.value for m in h] for h in histories), strict=True):
        assert 0.0 <= p1 <= p2 <= p4 <= 1.0  # pass@k grows with k
    assert (
        latest["eval/pass_at_1"] == pytest.approx(latest["eval/mean_at_4"])
        and latest["eval/accuracy"] == latest["eval/mean_at_4"]
    )


def test_lora_actor_with_kl_to_its_frozen_base(
    tmp_path: Path, tiny_model_dir: Path, ray_session, prefect_harness
) -> None:
    from safetensors.torch import load_file

    from rlstages.engines.training import state_io

    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"model.path={tiny_model_dir}",
            "model.provider=local",
            "model.lora={rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}",
            "algorithm.use_kl_loss=true",
            "actor.optim.lr=0.05",
            f"trainer.output_dir={tmp_path / 'runs'}",
            "trainer.run_name=lora",
            "cluster.mode=in_process",
            f"tracking.tracking_uri={mlflow_store(tmp_path)}",
            "tracking.log_model=false",
        ],
    )
    policy = Path(rl_post_train(cfg))
    client = MlflowClient(cfg.tracking.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    assert run.info.status == "FINISHED"
    kl = [m.value for m in client.get_metric_history(run.info.run_id, "actor/kl_loss")]
    assert len(kl) == 2 and kl[0] == 0.0 and kl[1] > 0.0  # the reference is the base: no KL until the adapter moves
    assert (
        max(m.value for m in client.get_metric_history(run.info.run_id, "rollout/logprob_diff")) < 1e-4
    )  # merged sync
    assert (policy / "model.safetensors").is_file() and (policy / "adapter" / "adapter_config.json").is_file()
    (ckpt,) = sorted((policy.parent / "checkpoints").rglob(state_io.MODEL_FILE))[-1:]
    assert all("lora_" in k for k in load_file(str(ckpt)))
