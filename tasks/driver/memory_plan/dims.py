"""The sizes of a run's model for the plan: from its config.json (or `model.tiny`), else, for the seed presets
whose weights are not here, from configs/published_models.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlstages.configs.run import RunConfig
from rlstages.engines.memory_models.model import ModelDims

PUBLISHED = Path(__file__).resolve().parents[3] / "configs" / "published_models.json"


def load_dims(cfg: RunConfig, hf_config: dict[str, Any] | None) -> tuple[ModelDims, str]:
    """The model's sizes and where they came from: the HF config given (config.json or model.tiny), else the
    published values in configs/published_models.json under the model directory's name."""
    if hf_config is not None:
        return ModelDims.from_hf(hf_config), "config.json" if cfg.model.tiny is None else "model.tiny"
    table = json.loads(PUBLISHED.read_text())
    name = Path(str(cfg.model.path)).name
    if name not in table:
        known = ", ".join(k for k in table if not k.startswith("_"))
        raise ValueError(
            f"model.path {cfg.model.path}: no config.json here and {name!r} is not in {PUBLISHED.name} "
            f"(known: {known}); give a model directory or add its sizes there"
        )
    return ModelDims.from_hf(table[name]), PUBLISHED.name
