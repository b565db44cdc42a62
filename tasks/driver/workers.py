"""The names the tasks and flows import for worker groups, in one place: cluster start-up and the registry of
live groups (`tasks.driver.cluster`) and config -> engine spec (`tasks.driver.specs`).
"""

from __future__ import annotations

from rlstages.tasks.driver.cluster import (
    NoWorkers,
    Workers,
    build_workers,
    forget_workers,
    get_workers,
    rebuild_workers,
    start_ray,
)
from rlstages.tasks.driver.specs import (
    converted_dir,
    converted_layout,
    hybrid_spec,
    loss_params,
    missing_backend_package,
    model_dir,
    reward_model_spec,
    reward_spec,
    rollout_spec,
    trainer_settings,
    training_spec,
)

__all__ = [
    "NoWorkers",
    "Workers",
    "build_workers",
    "converted_dir",
    "converted_layout",
    "forget_workers",
    "get_workers",
    "hybrid_spec",
    "loss_params",
    "missing_backend_package",
    "model_dir",
    "reward_model_spec",
    "reward_spec",
    "rollout_spec",
    "rebuild_workers",
    "start_ray",
    "trainer_settings",
    "training_spec",
]
