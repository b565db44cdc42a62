"""The small, serialisable handle that stage tasks pass around instead of actors or tensors.

A run lives in one directory: `config.yaml` (the resolved config), `run_state.json` (MLflow run id),
`steps/<step>/<stage>.safetensors` (the batches each stage wrote), `checkpoints/step_<N>/`, `final/`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

RUN_STATE = "run_state.json"  # the run's MLflow run id and status (tasks/run.py writes it)


@dataclass(frozen=True)
class RunHandle:
    """Name and directory of a training run; everything a stage needs to find its inputs."""

    name: str
    run_dir: str

    @property
    def path(self) -> Path:
        """The run directory."""
        return Path(self.run_dir)

    def step_dir(self, step: int) -> Path:
        """Where the stages of `step` write their batches."""
        return self.path / "steps" / f"{step:06d}"

    def batch(self, step: int, stage: str) -> Path:
        """The batch file a stage writes at `step`."""
        return self.step_dir(step) / f"{stage}.safetensors"

    def mlflow_run_id(self) -> str | None:
        """The MLflow run id recorded in the run state, or None before tracking started (or if unreadable)."""
        try:
            value = json.loads((self.path / RUN_STATE).read_text()).get("mlflow_run_id")
        except (OSError, ValueError, AttributeError):
            return None
        return str(value) if value else None

    @property
    def checkpoints(self) -> Path:
        """Where committed checkpoints live."""
        return self.path / "checkpoints"

    @property
    def key(self) -> str:
        """Registry key of this run's workers (unique per directory)."""
        return hashlib.sha1(str(self.path.resolve()).encode()).hexdigest()[:10]


def derive_seed(seed: int, step: int, stage: str) -> int:
    """A seed from (run seed, step, stage): a retried or replayed stage samples exactly the same."""
    digest = hashlib.sha256(f"{seed}:{step}:{stage}".encode()).digest()
    return int.from_bytes(digest[:4], "little")
