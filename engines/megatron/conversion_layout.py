"""Where and how a Megatron actor's HF checkpoint is converted before it starts: the cache directory's name (one per
parallel layout) and the converter's layout arguments. The registry entry's `hf_convert`; imports no megatron-core."""

from __future__ import annotations

from typing import Any

from rlstages.configs.training import MegatronTrainingConfig


def converted_layout(options: MegatronTrainingConfig, model_name: str) -> tuple[str, dict[str, Any]]:
    """(the converted checkpoint's directory name, `tasks.convert.convert_checkpoint`'s layout arguments)."""
    a = options
    vpp = f"-vpp{a.virtual_pipeline_model_parallel_size}" if a.virtual_pipeline_model_parallel_size else ""
    ep = f"-ep{a.expert_model_parallel_size}" if a.expert_model_parallel_size > 1 else ""
    ep += f"-etp{a.expert_tp}" if a.expert_tp != a.tensor_model_parallel_size else ""
    first, last = a.num_layers_in_first_pipeline_stage, a.num_layers_in_last_pipeline_stage
    ep += (f"-first{first}" if first else "") + (f"-last{last}" if last else "")  # uneven pipeline stages
    name = f"{model_name}-tp{a.tensor_model_parallel_size}-pp{a.pipeline_model_parallel_size}{vpp}{ep}"
    kwargs = {
        "tp": a.tensor_model_parallel_size,
        "pp": a.pipeline_model_parallel_size,
        "vpp": a.virtual_pipeline_model_parallel_size,
        "ep": a.expert_model_parallel_size,
        "etp": a.expert_tp,  # expert TP = TP is the default: no option, the same conversion
        "first_stage_layers": first,
        "last_stage_layers": last,
    }
    return name, kwargs
