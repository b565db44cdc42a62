"""Placement groups: reserve every worker's bundle up front, so an impossible layout fails fast (a clear
error, not a hang) and colocated roles share bundles.

Colocated: one placement group, bundle i shared by rank i of every trainer/rollout role (each takes an
equal fraction of the bundle's CPUs and GPUs, verl's colocated layout). Split: one placement group per role.
The reward scorer stays outside (it needs no reserved resources).
"""

from __future__ import annotations

from dataclasses import replace

from rlstages.configs import RunConfig
from rlstages.engines.runtime.actor_group import GroupSpec, Placement
from rlstages.tasks.context import RunHandle

RESERVED_ROLES = ("actor", "rollout", "reference", "critic")


def _bundle(cfg: RunConfig, specs: list[GroupSpec]) -> dict[str, float]:
    bundle: dict[str, float] = {"CPU": cfg.cluster.cpus_per_bundle}
    if cfg.cluster.num_gpus:
        bundle["GPU"] = cfg.cluster.gpus_per_worker
    for spec in specs:
        for key, value in spec.resources.items():
            bundle[key] = max(bundle.get(key, 0.0), value)
    return bundle


def _reserve(name: str, bundles: list[dict[str, float]], strategy: str, timeout: float) -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    try:
        ray.util.get_placement_group(name)
        return  # a retried task or a rebuilt group finds the reservation
    except ValueError:
        pass
    pg = placement_group(bundles, strategy=strategy, name=name)
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise ValueError(
            f"cluster: cannot reserve {len(bundles)} bundles of {bundles[0]} ({strategy}) within {timeout:g}s; the "
            f"cluster has {ray.cluster_resources()}; lower the worker counts or cluster.cpus_per_bundle"
        ) from None


def place(cfg: RunConfig, run: RunHandle, specs: dict[str, GroupSpec]) -> dict[str, GroupSpec]:
    """Reserve the placement groups of `specs` (role -> spec) and give each rank its bundle."""
    if not cfg.cluster.placement_group or cfg.cluster.mode != "ray":
        return specs
    roles = [r for r in RESERVED_ROLES if r in specs]
    sets = {"shared": roles} if cfg.cluster.colocate else {r: [r] for r in roles}
    out = dict(specs)
    for key, members in sets.items():
        name = pg_name(run, key)
        size = max(specs[r].num_workers for r in members)
        bundle = _bundle(cfg, [specs[r] for r in members])
        _reserve(name, [bundle] * size, cfg.cluster.placement_strategy, cfg.cluster.placement_timeout_seconds)
        share = len(members)
        for r in members:
            spec = specs[r]
            out[r] = replace(
                spec,
                placement=Placement(name, tuple(range(spec.num_workers))),
                num_cpus=bundle["CPU"] / share,
                num_gpus=bundle.get("GPU", 0.0) / share,
                resources={k: v / share for k, v in spec.resources.items()},
            )
    return out


def pg_name(run: RunHandle, key: str) -> str:
    """Name of a run's placement group (`shared` when colocated, else the role)."""
    return f"{run.name}-{run.key}-pg-{key}"


def release(run: RunHandle) -> None:
    """Remove the run's placement groups (at the end of a run)."""
    try:
        import ray
        from ray.util.placement_group import remove_placement_group
    except ImportError:
        return
    if not ray.is_initialized():
        return
    for key in ("shared", *RESERVED_ROLES):
        try:
            remove_placement_group(ray.util.get_placement_group(pg_name(run, key)))
        except ValueError:
            continue
