"""The training flow with the GSPO and KL-Cov policy losses (2 steps, with rollout IS weights and token-sum; every
loss is trained at engine level in tests/engines/training/test_trainer_policy_losses.py), and
one-step-off-policy generation on the split layout (rollout and trainer in different Ray workers), on the tiny
preset with real Prefect (no server), Ray and an MLflow SQLite store. CPU only, a few minutes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file
from session_cache import mlflow_store

from rlstages.configs import RunConfig, load_config
from rlstages.flows.train import rl_post_train

ROOT = Path(__file__).resolve().parents[2]


def cheap_cfg(tmp: Path, model_dir: Path, name: str, *extra: str) -> RunConfig:
    """tiny.yaml, no evaluation before training, one checkpoint at the end."""
    return load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"model.path={model_dir}",
            "model.provider=local",
            f"trainer.output_dir={tmp / 'runs'}",
            f"trainer.run_name={name}",
            "trainer.eval_at_start=false",
            "trainer.eval_every=0",
            "checkpoint.every=0",
            f"tracking.tracking_uri={mlflow_store(tmp)}",
            "tracking.log_model=false",
            "prefect.default.retry_delay_seconds=0",
            *extra,
        ],
    )


def history(cfg: RunConfig, key: str) -> dict[int, float]:
    client = MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    run = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{cfg.trainer.run_name}'")[0]
    assert run.info.status == "FINISHED"
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}


def changed_tensors(cfg: RunConfig, model_dir: Path) -> int:
    initial = load_file(str(model_dir / "model.safetensors"))
    final = load_file(str(cfg.trainer.output_dir / str(cfg.trainer.run_name) / "final" / "model.safetensors"))
    return sum(not torch.equal(initial[k], final[k]) for k in initial)


# Each policy loss trains at engine level (tests/engines/training/test_trainer_policy_losses.py: every loss moves the
# parameters, with and without IS weights) and its options reach the loss (tests/configs/test_algorithm_options.py).
# Through the flow, two runs carry every flow-level option: KL-Cov with token-sum and token-level IS weights (was
# the vanilla case's), GSPO with sequence-level masked IS weights; the vanilla, CISPO and Clip-Cov flows were merged
# into these (tests/README.md).
CASES = {
    "gspo": [
        "algorithm.loss_agg_mode=seq-mean-token-mean",
        "algorithm.rollout_is.level=sequence",
        "algorithm.rollout_is.mode=mask",
    ],
    "kl_cov": ["algorithm.loss_agg_mode=token-sum", "algorithm.rollout_is.level=token"],
}


@pytest.mark.parametrize("loss", list(CASES))
def test_two_steps_with_each_policy_loss(loss, tmp_path: Path, tiny_model_dir: Path, ray_session, prefect_harness):
    """Two PPO epochs per step, so the second sees ratios != 1 and each loss's own branch runs. The engines run
    in the driver (`cluster.mode=in_process`): the loss is the point here, Ray's actors are the off-policy test's."""
    cfg = cheap_cfg(tmp_path, tiny_model_dir, f"loss-{loss}", f"algorithm.policy_loss={loss}", "actor.ppo_epochs=2",
                    "cluster.mode=in_process", *CASES[loss])  # fmt: skip
    rl_post_train(cfg)
    assert changed_tensors(cfg, tiny_model_dir) > 0
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "rollout_corr/kl"):
        assert sorted(history(cfg, key)) == [1, 2], key
    grad_norms = history(cfg, "actor/grad_norm")
    assert max(grad_norms.values()) > 0 and all(math.isfinite(v) for v in grad_norms.values()), grad_norms
    if loss in ("gspo", "kl_cov"):  # GSPO's 4e-4 band clips after one update; KL-Cov always penalises >= 1 token
        assert max(history(cfg, "actor/pg_clipfrac").values()) > 0
    if CASES[loss]:  # same weights in rollout and trainer at the start: ratios ~1, weights applied every step
        ratios = history(cfg, "rollout_corr/is_ratio_mean")
        assert sorted(ratios) == [1, 2] and all(abs(r - 1) < 1e-3 for r in ratios.values())


def test_one_step_off_policy_on_the_split_layout(tmp_path: Path, tiny_model_dir: Path, ray_session, prefect_harness):
    """Steps 2 and 3 train on rollouts generated during the previous step with weights one update old: the
    rollout-trainer mismatch is ~0 at step 1 and clearly nonzero after, and the IS weights see it."""
    cfg = cheap_cfg(tmp_path, tiny_model_dir, "off-policy", "trainer.total_steps=3", "trainer.one_step_off_policy=true",
                    "cluster.hybrid_engine=false", "algorithm.rollout_is.level=token")  # fmt: skip
    assert not cfg.cluster.hybrid_engine and cfg.cluster.mode == "ray"  # rollout and trainer: separate workers
    rl_post_train(cfg)
    assert changed_tensors(cfg, tiny_model_dir) > 0
    assert sorted(history(cfg, "reward/mean")) == [1, 2, 3]
    assert sorted(history(cfg, "timing/generate_s")) == [1]  # generated in step; later ones ran ahead
    assert sorted(history(cfg, "rollout/generate_ahead_s")) == [2, 3]
    diff = history(cfg, "rollout_corr/logprob_abs_diff")
    assert diff[1] < 1e-4 and diff[2] > 10 * max(diff[1], 1e-5) and diff[3] > 10 * max(diff[1], 1e-5), diff
    assert all(abs(r - 1) > 1e-5 for s, r in history(cfg, "rollout_corr/is_ratio_mean").items() if s > 1)
