"""The algorithm options of issue 15 in the config: defaults leave the demo unchanged, bad values name the field,
and the loss knobs reach the trainer's `PolicyLossParams`. CPU only, no workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlstages.configs import ConfigError, load_config
from rlstages.tasks.driver.workers import loss_params

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_vanilla_synchronous_and_without_is() -> None:
    for preset in ("demo.yaml", "tiny.yaml"):
        cfg = load_config(ROOT / "configs" / preset)
        assert cfg.algorithm.policy_loss == "vanilla" and cfg.algorithm.rollout_is.level == "none"
        assert not cfg.trainer.one_step_off_policy and not cfg.needs_old_logprobs
        params = loss_params(cfg)
        assert params.name == "vanilla" and params.dp_size == 1


def test_options_reach_the_loss_params_and_ask_for_old_logprobs() -> None:
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        ["algorithm.policy_loss=gspo", "algorithm.gspo.clip_ratio_high=0.001", "algorithm.loss_agg_mode=token-sum",
         "algorithm.kl_cov.coef=0.5", "algorithm.rollout_is.level=sequence"],
    )  # fmt: skip
    params = loss_params(cfg)
    assert (params.name, params.gspo_clip_ratio_high, params.loss_agg_mode) == ("gspo", 0.001, "token-sum")
    assert params.kl_cov_coef == 0.5
    assert cfg.needs_old_logprobs  # IS weights are pi_old / pi_rollout
    off = load_config(ROOT / "configs" / "tiny.yaml", ["trainer.one_step_off_policy=true"])
    assert off.needs_old_logprobs  # pi_old is not the rollout's policy any more


def test_the_mode_replaces_the_old_flag_which_still_works() -> None:
    """`trainer.one_step_off_policy: true` is `mode: one_step_off`; the async section reads as `trainer.async`."""
    tiny = ROOT / "configs" / "tiny.yaml"
    old = load_config(tiny, ["trainer.one_step_off_policy=true", "cluster.hybrid_engine=false"])
    assert old.trainer.mode == "one_step_off" and old.trainer.overlaps_generation
    new = load_config(tiny, ["trainer.mode=one_step_off", "cluster.hybrid_engine=false"])
    assert new.trainer.one_step_off_policy and new == old
    run = load_config(tiny, ["trainer.mode=async", "cluster.hybrid_engine=false", "trainer.async.max_staleness=3"])
    assert run.trainer.async_.max_staleness == 3 and not run.trainer.one_step_off_policy and run.needs_old_logprobs
    assert load_config(tiny).trainer.mode == "sync" and not load_config(tiny).trainer.overlaps_generation
    resolved = load_config(tiny, ["trainer.async={max_staleness: 1, partial_rollout: false, queue_capacity: null}"])
    assert resolved.trainer.mode == "sync"  # a resolved config.yaml lists the section at its defaults: accepted
    decoupled = load_config(tiny, ["algorithm.decoupled_loss=true"])
    weight = decoupled.algorithm.behaviour_correction()  # never skipped: token TIS when rollout_is is off
    assert decoupled.needs_old_logprobs and (weight.level, weight.mode, weight.threshold) == ("token", "truncate", 2)
    masked = load_config(tiny, ["algorithm.decoupled_loss=true", "algorithm.rollout_is.mode=mask",
                                "algorithm.rollout_is.level=sequence"])  # fmt: skip
    assert masked.algorithm.behaviour_correction().mode == "mask"


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["algorithm.policy_loss=ppo"], "algorithm.policy_loss"),
        (["algorithm.loss_agg_mode=sum"], "algorithm.loss_agg_mode"),
        (["algorithm.rollout_is.level=row"], "algorithm.rollout_is.level"),
        (["algorithm.rollout_is.threshold=0.5"], "algorithm.rollout_is.threshold"),
        (["algorithm.clip_cov.ratio=0"], "algorithm.clip_cov.ratio"),
        (["algorithm.clip_cov.lb=6"], "algorithm.clip_cov.lb=6.0 must be < algorithm.clip_cov.ub"),
        (["trainer.one_step_off_policy=true", "cluster.hybrid_engine=true"], "cluster.hybrid_engine: false"),
        (
            [
                "trainer.mode=async",
                "trainer.async.partial_rollout=true",
                "cluster.hybrid_engine=false",
                "rollout.multi_turn={enabled: true, environment: {tools: [{name: calculator}]}}",
            ],
            "trainer.async.partial_rollout streams single-turn text prompts only",
        ),
        (["trainer.mode=sync", "trainer.one_step_off_policy=true"], "contradicts trainer.mode: sync"),
        (
            ["trainer.mode=async", "cluster.hybrid_engine=false", "trainer.async.max_staleness=-1"],
            "trainer.async.max_staleness",
        ),
    ],
)
def test_bad_values_name_the_field(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(ROOT / "configs" / "tiny.yaml", overrides)
    assert needle in str(info.value) and "\n" not in str(info.value)
