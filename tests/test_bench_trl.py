"""bench/bench_trl.py gives TRL's GRPOTrainer the config's objective: the entropy bonus, the advantages' std
scaling and the loss aggregation, mapped field by field; a loss TRL has no counterpart for is refused by name, not
run as a different objective; TRL trains under bf16 autocast only where bf16 is native. CPU only, instant (no TRL
needed: the mapping is plain data).
Run: pytest tests/test_bench_trl.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_trl import trl_algorithm
from rlstages.configs import load_config

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def test_the_demo_maps_to_trls_group_scaled_token_mean_with_its_entropy_bonus() -> None:
    demo = load_config(DEMO)
    assert trl_algorithm(demo) == {
        "entropy_coef": demo.algorithm.entropy_coeff,
        "scale_rewards": "group",
        "loss_type": "dapo",
    }
    assert demo.algorithm.entropy_coeff > 0  # the bonus TRL ran without until round 17


def test_dr_grpo_maps_to_unscaled_rewards_and_trls_dr_grpo_loss() -> None:
    cfg = load_config(DEMO, ["algorithm.norm_adv_by_std=false", "algorithm.loss_agg_mode=seq-mean-token-sum-norm"])
    mapped = trl_algorithm(cfg)
    assert mapped["scale_rewards"] == "none" and mapped["loss_type"] == "dr_grpo"


def test_a_loss_trl_lacks_is_refused_by_name() -> None:
    cfg = load_config(DEMO, ["algorithm.loss_agg_mode=token-sum"])
    with pytest.raises(ValueError, match="algorithm.loss_agg_mode='token-sum'"):
        trl_algorithm(cfg)


def test_trl_trains_under_bf16_autocast_only_where_bf16_is_native() -> None:
    from bench.bench_trl import trl_autocast

    demo = load_config(DEMO)
    assert trl_autocast(demo, fp32_kernel=False)  # a GPU, AMX, a CPU whose bf16 GEMM timed as fast
    assert not trl_autocast(demo, fp32_kernel=True)  # AVX2: fp32, TRL's fastest setting there
    fp32 = load_config(DEMO, ["model.dtype=float32", "actor.bf16_autocast=false", "actor.bf16_stochastic_round=false"])
    assert not trl_autocast(fp32, fp32_kernel=False)
