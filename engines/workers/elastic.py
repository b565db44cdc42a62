"""Resizing a running rollout group (the elastic fleet, docs/async.md): one rank added or removed at a time.

A group built by `ActorGroup` names its ranks `<group>:<rank>`; a rank added later is `<group>:j<id>` (ids never
reused), so a later rebuild of the configured ranks never finds a joiner by name. A joiner is scheduled outside the
run's placement groups, with the group's per-rank resources (`num_cpus`, `num_gpus`, custom ones): Ray puts it on
any node that has them free. Only groups of one actor per data-parallel rank (tp = pp = 1, the rollout's) resize.
`replace_rank` puts a fresh actor in a dead rank's place (same index, same placement-group bundle): partial
rollouts' streams are per rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from rlstages.engines.imports import import_object
from rlstages.engines.workers.actor_group import ActorGroup, Placement, _with_rendezvous


def _check(group: ActorGroup) -> None:
    if group.in_process:
        raise ValueError(f"group {group.spec.name}: an in-process group does not resize (cluster.mode=ray only)")
    if group.spec.tp * group.spec.pp != 1:
        raise ValueError(f"group {group.spec.name}: only groups of tp = pp = 1 resize")


def _resized(group: ActorGroup, bundles: tuple[int, ...] | None) -> None:
    """The spec follows the handles: a rebuild from it places what is there now (outside placement groups once
    a joiner is in)."""
    placement = group.spec.placement
    if bundles is None or placement.group_name is None:
        placement = Placement()
    else:
        placement = Placement(placement.group_name, bundles)
    group.spec = replace(group.spec, num_workers=len(group.handles), placement=placement)


def names(group: ActorGroup) -> list[str]:
    """Every rank's actor name, in rank order (kept on the group once it has been resized)."""
    if not hasattr(group, "names"):
        group.names = [f"{group.spec.name}:{r}" for r in range(len(group.handles))]  # type: ignore[attr-defined]
    return list(group.names)  # type: ignore[attr-defined]


def add_rank(group: ActorGroup, worker_id: str, timeout: float, bundle: tuple[str, int] | None = None) -> Any:
    """Start one more rank of the group's engine (`<group>:j<worker_id>`; in `bundle`, a placement group's name and
    bundle index, else wherever its resources are free), wait until its constructor ran, and append it as the last
    rank; returns its handle. Raises what Ray raises when it cannot start in `timeout` s (the actor is killed
    first: no half-joined rank stays behind)."""
    import ray

    _check(group)
    current = names(group)
    spec = group.spec
    name = f"{spec.name}:j{worker_id}"
    options = group._options(0)  # the group's env and resources; rank 0's rendezvous env is not used (tp = 1)
    options.pop("scheduling_strategy", None)
    if bundle is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = ray.util.get_placement_group(bundle[0])
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle[1])
    options["name"] = name
    env = options["runtime_env"]["env_vars"]
    env["RANK"], env["WORLD_SIZE"] = str(len(current)), str(len(current) + 1)
    remote_cls: Any = ray.remote(_with_rendezvous(import_object(spec.engine)))
    handle = remote_cls.options(**options).remote(**spec.kwargs)
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=timeout)
    except BaseException:
        ray.kill(handle, no_restart=True)
        raise
    group.handles.append(handle)
    group.names = [*current, name]  # type: ignore[attr-defined]
    _resized(group, None)
    return handle


def remove_rank(group: ActorGroup, index: int) -> str:
    """Kill rank `index` (already dead, or leaving on request) and close the gap; returns its actor name."""
    import ray

    _check(group)
    current = names(group)
    handle = group.handles.pop(index)
    name = current.pop(index)
    group.names = current  # type: ignore[attr-defined]
    try:
        ray.kill(handle, no_restart=True)
    except ValueError:
        pass
    bundles = group.spec.placement.bundle_indices
    kept = tuple(b for i, b in enumerate(bundles) if i != index) if len(bundles) == len(group.handles) + 1 else None
    _resized(group, kept)
    return name


def replace_rank(group: ActorGroup, index: int, worker_id: str, timeout: float) -> Any:
    """Kill rank `index` (dead) and start a fresh rank of the group's engine at the same index, in the same bundle
    of the group's placement group where it had one (`<group>:j<worker_id>`); returns its handle. Raises what
    `add_rank` raises (the group is then one rank short)."""
    placement = group.spec.placement
    bundles = placement.bundle_indices
    placed = placement.group_name is not None and len(bundles) == len(group.handles)
    remove_rank(group, index)
    bundle = (str(placement.group_name), bundles[index]) if placed else None
    handle = add_rank(group, worker_id, timeout, bundle)
    current = names(group)
    group.handles.insert(index, group.handles.pop())
    current.insert(index, current.pop())
    group.names = current  # type: ignore[attr-defined]
    _resized(group, tuple(bundles) if placed else None)
    return handle
