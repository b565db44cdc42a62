"""Where a run's small coordinating actors go: beside the driver, not on a worker node that may leave."""

from __future__ import annotations

from typing import Any


def beside_driver() -> Any:
    """A node affinity to the calling driver's node: the run's small coordinating actors (the reward scorer, the
    rollout queue) live and die with the driver, not with a worker node that a spot reclaim or a scale-down takes
    away. They reserve no resources, so that node always fits them. Not soft: Ray's soft affinity placed them on
    other nodes of a cluster whose head has no CPUs (tests/cluster: 3 of 4 tries)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
