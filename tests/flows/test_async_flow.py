"""`trainer.mode: async` through the real flow (tiny preset, 3 steps, engines in the driver: the schedule is the
point, not Ray; real Prefect and MLflow): eta 0 is the synchronous run bit for bit, eta 1 without partial rollouts
is the one-step-off run bit for bit, and each step logs the lag of its tokens (0, then eta), queue depth and idle
fractions. CPU, about a minute."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlstages.configs import RunConfig
from rlstages.flows.train import rl_post_train
from tests.flows.flow_support import IN_DRIVER, final_weights, mlflow_run, run_dir, same, tiny_cfg

SPLIT = ("cluster.hybrid_engine=false", "trainer.total_steps=3", "trainer.eval_every=0", "checkpoint.every=0",
         "trainer.eval_at_start=false", IN_DRIVER)  # fmt: skip


def history(cfg: RunConfig, key: str) -> dict[int, float]:
    """Metric `key` of the run by step."""
    client, run = mlflow_run(cfg)
    assert run.info.status == "FINISHED"
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}


def rollouts(cfg: RunConfig, step: int) -> dict:
    """The rollout batch the run trained on at `step`, as tensors."""
    return load_file(str(run_dir(cfg) / "steps" / f"{step:06d}" / "rollout.safetensors"))


@pytest.mark.parametrize(("eta", "baseline"), [(0, "trainer.mode=sync"), (1, "trainer.mode=one_step_off")])
def test_async_equals_its_synchronous_counterpart_bitwise(
    eta: int, baseline: str, tmp_path: Path, tiny_model_dir: Path, prefect_harness
) -> None:
    base = tiny_cfg(tmp_path, tiny_model_dir, f"base-{eta}", baseline, *SPLIT)
    run = tiny_cfg(tmp_path, tiny_model_dir, f"async-{eta}", "trainer.mode=async",
                   f"trainer.async.max_staleness={eta}", *SPLIT)  # fmt: skip
    rl_post_train(base)
    rl_post_train(run)
    assert same(final_weights(base), final_weights(run))
    for step in (1, 2, 3):
        a, b = rollouts(base, step), rollouts(run, step)
        assert all(a[k].equal(b[k]) for k in a), step  # the same tokens and log-probs, step by step
    assert history(run, "reward/mean") == history(base, "reward/mean")
    assert history(run, "async/lag_max") == {1: 0.0, 2: float(eta), 3: float(eta)}  # version 0 made steps 1-2
    assert history(run, f"async/lag_hist/{eta}")[3] == 1.0
    assert set(history(run, "async/queue_depth")) == {1, 2, 3}
    for key in ("async/trainer_idle_fraction", "async/rollout_idle_fraction"):
        assert all(0.0 <= v <= 1.0 for v in history(run, key).values()), key
    versions = load_file(str(run_dir(run) / "steps" / "000003" / "versions.safetensors"))["rollout_versions"]
    mask = rollouts(run, 3)["response_mask"] > 0
    assert versions[mask].unique().tolist() == [max(0, 2 - eta)] and not versions[~mask].any()
