"""The seeds' Mixture-of-Experts presets (Qwen3-235B: TP4 x PP8 x EP4 on 32 GPUs; DeepSeek-V3 671B: TP8 x PP12 x EP8
on 96 GPUs, offload_fraction 1.0): their layouts as the seed sets them, accepted by `rlstages config show` and the
pre-flight's config checks against a cluster of their size, refused with "not enough GPUs" against a smaller one;
the MoE layout checks (EP x expert TP x PP dividing the ranks, EP dividing the experts, uneven first / last
pipeline stages adding up); the router options' defaults (dropless, no aux loss beyond HF's forward)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlstages.configs import load_config
from rlstages.configs.run import gpus_needed
from rlstages.configs.training import MegatronTrainingConfig
from rlstages.tasks.driver.specs import trainer_settings

ROOT = Path(__file__).resolve().parents[2]
QWEN3 = ROOT / "configs" / "qwen3_235b_grpo_megatron.yaml"
DSV3 = ROOT / "configs" / "deepseek_v3_671b_grpo_megatron.yaml"
# preset -> (GPUs, TP, PP, EP, stage layers)
LAYOUTS = {QWEN3: (32, 4, 8, 4, [11] + [12] * 6 + [11]), DSV3: (96, 8, 12, 8, [5] * 11 + [6])}


@pytest.mark.parametrize("preset", LAYOUTS, ids=lambda p: p.stem)
def test_moe_preset_has_the_seed_layout_and_fits_its_cluster(preset: Path) -> None:
    gpus, tp, pp, ep, stages = LAYOUTS[preset]
    cfg = load_config(preset)
    actor = cfg.actor
    assert isinstance(actor, MegatronTrainingConfig)
    sizes = (actor.tensor_model_parallel_size, actor.pipeline_model_parallel_size, actor.expert_model_parallel_size)
    assert sizes == (tp, pp, ep) and actor.num_workers == gpus and actor.data_parallel_size == 1
    assert actor.expert_tp == 1 and actor.offload_fraction == 1.0 and actor.param_offload
    assert actor.moe.expert_capacity_factor is None  # dropless, as HF
    assert actor.stage_layers(cfg.model.architecture.num_hidden_layers) == stages
    assert cfg.cluster.num_gpus == gpus and gpus_needed(cfg) == gpus
    ref = trainer_settings(cfg, "reference").train  # the Megatron reference runs the actor's layout
    assert isinstance(ref, MegatronTrainingConfig) and ref.expert_model_parallel_size == ep
    assert ref.tensor_model_parallel_size == tp and ref.num_layers_in_last_pipeline_stage is not None


@pytest.mark.parametrize("preset", LAYOUTS, ids=lambda p: p.stem)
def test_moe_preset_is_refused_on_a_smaller_cluster(preset: Path) -> None:
    gpus = LAYOUTS[preset][0]
    with pytest.raises(ValueError, match=f"not enough GPUs: need {gpus}, have {gpus // 2}"):
        load_config(preset, [f"cluster.num_gpus={gpus // 2}"])


def test_config_show_accepts_both_presets() -> None:
    from typer.testing import CliRunner

    from rlstages.flows.cli.main import app

    for preset in LAYOUTS:  # the presets name model directories of their own cluster: the config alone is checked
        out = CliRunner().invoke(app, ["config", "show", str(preset), "--schema-only"])
        assert out.exit_code == 0, out.output[-2000:]
        assert "expert_model_parallel_size" in out.stdout and "expert_tensor_parallel_size: 1" in out.stdout
        here = CliRunner().invoke(app, ["config", "show", str(preset)])  # the whole pre-flight: no such model here
        assert here.exit_code == 2 and "model.path" in here.output and "does not exist" in here.output
        small = CliRunner().invoke(app, ["config", "show", str(preset), "--schema-only", "cluster.num_gpus=8"])
        assert small.exit_code == 2 and "not enough GPUs" in small.output


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["model.architecture.num_experts=6"], "must divide the model's 6 routed experts"),
        (["actor.expert_tensor_parallel_size=4"], "expert_model_parallel_size x expert_tensor_parallel_size x"),
        (["actor.num_layers_in_first_pipeline_stage=12"], "do not split evenly"),
        (["model.architecture.num_experts=0"], "the model is dense"),
    ],
)
def test_moe_layout_checks(overrides: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        load_config(QWEN3, overrides)


@pytest.mark.parametrize("preset", LAYOUTS, ids=lambda p: p.stem)
def test_moe_preset_fits_its_memory_plan_on_h20(preset: Path) -> None:
    """`rlstages plan PRESET --gpu H20` says it fits, as verl runs these layouts on 96 GB GPUs: the Qwen3-235B
    preset with verl's full activation recompute (without it the plan's 46 GiB of activations do not fit)."""
    from typer.testing import CliRunner

    from rlstages.flows.cli.main import app

    out = CliRunner().invoke(app, ["plan", str(preset), "--gpu", "H20"])
    assert out.exit_code == 0 and "fits: True" in out.output, out.output[-2000:]
    if preset == QWEN3:
        assert load_config(preset).actor.gradient_checkpointing
        tight = CliRunner().invoke(app, ["plan", str(preset), "--gpu", "H20", "actor.gradient_checkpointing=false"])
        assert tight.exit_code == 3 and "fits: False" in tight.output
