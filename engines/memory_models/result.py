"""What the plan returns: each distinct rank's bytes (GPU by component and phase, host) and the whole plan with its
fullest rank, the fit against the named GPU, the table rows and the headline figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlstages.engines.memory_models.gpus import GIB
from rlstages.engines.memory_models.model import ModelDims


@dataclass
class RankMemory:
    """One rank's bytes: GPU by component and phase, host memory by component."""

    role: str
    stage: int
    layers: int
    params: int
    gpu: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def peak(self) -> float:
        """The largest phase (train, rollout, sync) on this rank's GPU."""
        return max(self.phases.values()) if self.phases else sum(self.gpu.values())

    @property
    def peak_phase(self) -> str:
        """Which phase is the largest."""
        return max(self.phases, key=self.phases.__getitem__) if self.phases else "train"

    @property
    def host(self) -> float:
        """Host bytes this rank's offload takes."""
        return sum(self.cpu.values())


@dataclass
class MemoryPlan:
    """The plan: the model's sizes, each distinct rank, the fullest, the GPU it is checked against, advice."""

    dims: ModelDims
    source: str
    ranks: list[RankMemory]
    gpu: str | None
    capacity: int | None
    node_cpu: float
    nodes: int
    advice: list[str]
    prompt_tokens: int  # the prompt length the activations were planned for
    prompts_from: str  # where it came from (data.max_prompt_length, measured, assumed)

    @property
    def fullest(self) -> RankMemory:
        """The rank with the largest GPU peak."""
        return max(self.ranks, key=lambda r: r.peak)

    @property
    def fits(self) -> bool | None:
        """Whether the fullest rank fits the named GPU (None: no GPU named)."""
        return None if self.capacity is None else self.fullest.peak <= self.capacity

    def rows(self) -> list[dict[str, Any]]:
        """One dict per distinct rank, in GiB (the table `rlstages plan` prints)."""
        return [
            {
                "role": r.role,
                "stage": r.stage,
                "layers": r.layers,
                "params": r.params,
                **{k: round(v / GIB, 2) for k, v in r.gpu.items()},
                **{f"{k}_phase": round(v / GIB, 2) for k, v in r.phases.items()},
                "peak_gib": round(r.peak / GIB, 2),
                "peak_at": r.peak_phase,
                "cpu_gib": round(r.host / GIB, 2),
            }
            for r in self.ranks
        ]

    def summary(self) -> dict[str, Any]:
        """The headline figures (also appended by `config show`)."""
        full = self.fullest
        return {
            "model_params": f"{self.dims.total_params():,}",
            "active_params": f"{self.dims.active_params():,}",
            "dims_from": self.source,
            "fullest_rank": f"{full.role} stage {full.stage}",
            "gpu_peak_gib": round(full.peak / GIB, 2),
            "gpu_peak_phase": full.peak_phase,
            "gpu": self.gpu,
            "gpu_capacity_gib": None if self.capacity is None else round(self.capacity / GIB, 2),
            "fits": self.fits,
            "cpu_per_rank_gib": round(max(r.host for r in self.ranks) / GIB, 2),
            "cpu_per_node_gib": round(self.node_cpu / GIB, 2),
            "nodes": self.nodes,
            "prompt_tokens": f"{self.prompt_tokens} ({self.prompts_from})",
        }
