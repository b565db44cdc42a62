"""The cluster section's GPU checks: placement groups on whenever GPUs are requested, colocation counted as
shared GPU slots (rollout TP width included), placement_group=false with GPUs refused, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlstages.configs import load_config
from rlstages.configs.run import gpu_slots, gpus_needed

ROOT = Path(__file__).resolve().parents[2]
MEGATRON = ROOT / "configs" / "qwen2_7b_grpo_megatron.yaml"


def test_gpu_presets_reserve_placement_groups_and_fit() -> None:
    mega = load_config(MEGATRON)
    assert mega.cluster.use_placement_group  # not set in the preset: GPUs turn it on
    assert gpu_slots(mega) == {"actor": 8, "rollout": 8, "reference": 8}  # rollout 4 workers x TP 2
    assert gpus_needed(mega) == 8  # colocated: bundle i shared by rank i of every role
    split = load_config(ROOT / "configs" / "deepspeed_vllm.yaml")
    assert split.cluster.use_placement_group and gpus_needed(split) == 16  # 4 actor + 4 rollout + 4 critic + 4 ref
    assert not load_config(ROOT / "configs" / "tiny.yaml").cluster.use_placement_group  # CPU: off unless asked


def test_placement_group_off_with_gpus_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cluster.placement_group=false with cluster.num_gpus=8: .* = 24"):
        load_config(MEGATRON, ["cluster.placement_group=false"])


def test_colocated_slots_count_the_rollout_tp_width() -> None:
    with pytest.raises(ValueError, match=r"asks for 10 GPUs \(actor=8, rollout=10, reference=8"):
        load_config(MEGATRON, ["rollout.num_workers=5"])
    with pytest.raises(ValueError, match=r"asks for 24 GPUs .* split \(sum over roles\)"):
        load_config(MEGATRON, ["cluster.colocate=false"])
