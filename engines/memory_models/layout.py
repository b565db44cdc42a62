"""A role's parallel layout (TP / PP / CP / EP / ETP / DP, layers per pipeline stage, as the backend's memory model
places them: `backends.MegatronMemory.layout`) and the weights one rank of a stage holds."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlstages.engines.memory_models.model import ModelDims


@dataclass(frozen=True)
class Layout:
    """A role's parallel layout: TP / PP / CP / EP / ETP / DP and the layers of each pipeline stage."""

    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    stages: tuple[int, ...] = ()

    @property
    def dp(self) -> int:
        """Data-parallel ranks of the dense weights."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Data-parallel ranks of the expert weights."""
        return max(1, self.world // (self.ep * self.etp * self.pp))


def stage_params(dims: ModelDims, lay: Layout, stage: int) -> tuple[int, int, int]:
    """(dense weights, expert weights, layers) on one rank of pipeline stage `stage`."""
    first = sum(lay.stages[:stage])
    layers = range(first, first + lay.stages[stage])
    dense = sum(dims.layer_dense_params(i) for i in layers)
    experts = sum(dims.experts // lay.ep * dims.expert_params() for i in layers if dims.is_moe_layer(i))
    embed = dims.vocab * dims.hidden
    if stage == 0:
        dense += embed
    if stage == lay.pp - 1:
        dense += dims.hidden + (embed if (not dims.tied or lay.pp > 1) else 0)
    return math.ceil(dense / lay.tp), math.ceil(experts / lay.etp), lay.stages[stage]
