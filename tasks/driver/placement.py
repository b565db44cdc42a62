"""Placement groups: reserve every worker's bundle up front, so an impossible layout fails fast (a clear
error, not a hang) and colocated roles share bundles.

Colocated: one placement group, bundle i shared by rank i of every trainer/rollout role (each takes an
equal fraction of the bundle's CPUs and GPUs, verl's colocated layout); a rollout worker of tensor-parallel
width t sits on bundle i x t, the first of its t GPU slots. Split: one placement group per role (a rollout
bundle holds its worker's t GPUs). The reward scorer stays outside (it reserves nothing): on the driver's node.
Placement groups are on whenever GPUs are requested (`ClusterConfig.use_placement_group`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from rlstages.configs import RunConfig
from rlstages.configs.rollout import rollout_tp
from rlstages.engines.workers.actor_group import ActorGroup, GroupSpec, Placement
from rlstages.tasks.driver.context import RunHandle

RESERVED_ROLES = ("actor", "rollout", "reference", "critic")


def _width(cfg: RunConfig, role: str) -> int:
    """GPU slots one worker of `role` spans (the rollout's tensor-parallel width; 1 for trainer ranks)."""
    return rollout_tp(cfg.rollout) if role == "rollout" else 1


def _bundle(cfg: RunConfig, specs: list[GroupSpec], width: int = 1) -> dict[str, float]:
    bundle: dict[str, float] = {"CPU": cfg.cluster.cpus_per_bundle}
    if cfg.cluster.num_gpus:
        bundle["GPU"] = cfg.cluster.gpus_per_worker * width
    for spec in specs:
        for key, value in spec.resources.items():
            bundle[key] = max(bundle.get(key, 0.0), value)
    return bundle


def _shortage(bundles: list[dict[str, float]], available: dict[str, float]) -> str:
    """`not enough GPUs: need X, have Y` (or CPUs / a custom resource) for the first resource that is short;
    `available` = what is free on the alive nodes (other reservations of the run hold the rest)."""
    need: dict[str, float] = {}
    for b in bundles:
        for key, value in b.items():
            need[key] = need.get(key, 0.0) + value
    for key in ("GPU", *sorted(k for k in need if k != "GPU")):
        if key in need and need[key] > available.get(key, 0.0) + 1e-9:
            label = {"GPU": "GPUs", "CPU": "CPUs"}.get(key, f"'{key}'")
            return f"not enough {label}: need {need[key]:g}, have {available.get(key, 0.0):g}"
    return "the resources exist in total but no node fits the bundles together (placement strategy)"


def _reserve(name: str, bundles: list[dict[str, float]], strategy: str, timeout: float) -> None:
    """Create (or find) the named placement group and wait until every bundle is placed, or fail clearly.
    A group found by name is waited for too: after a node died its bundles may be rescheduling."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    try:
        pg = ray.util.get_placement_group(name)
    except ValueError:
        pg = placement_group(bundles, strategy=strategy, name=name)
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        free, total = ray.available_resources(), ray.cluster_resources()  # alive nodes only
        raise ValueError(
            f"cluster: {_shortage(bundles, free)} (cannot reserve {len(bundles)} bundles of {bundles[0]}, "
            f"{strategy}, within {timeout:g}s; free {free}, in total {total}); lower the worker counts, "
            "cluster.cpus_per_bundle, or add nodes"
        ) from None


def reserved_bundles(cfg: RunConfig) -> int:
    """How many bundles `place` reserves for this config (colocated: one per GPU slot of the widest role;
    split: one per worker of every role), each of `cluster.cpus_per_bundle` CPUs: the pre-flight's count."""
    workers = {"actor": cfg.actor.num_workers}
    if not cfg.cluster.hybrid_engine:  # the hybrid engine's rollout lives in the actor's ranks
        workers["rollout"] = cfg.rollout.num_workers
    if cfg.uses_reference and cfg.model.lora is None:  # under LoRA the actor's frozen base is the reference
        workers["reference"] = cfg.reference.num_workers
    if cfg.critic is not None:
        workers["critic"] = cfg.critic.num_workers
    if cfg.cluster.colocate:
        return max(n * _width(cfg, role) for role, n in workers.items())
    return sum(workers.values())


def place(cfg: RunConfig, run: RunHandle, specs: dict[str, GroupSpec]) -> dict[str, GroupSpec]:
    """Reserve the placement groups of `specs` (role -> spec) and give each rank its bundle."""
    if not cfg.cluster.use_placement_group or cfg.cluster.mode != "ray":
        return specs
    roles = [r for r in RESERVED_ROLES if r in specs]
    sets = {"shared": roles} if cfg.cluster.colocate else {r: [r] for r in roles}
    out = dict(specs)
    for key, members in sets.items():
        name = pg_name(run, key)
        if cfg.cluster.colocate:  # one bundle per GPU slot, shared by every role
            size = max(specs[r].num_workers * _width(cfg, r) for r in members)
            bundle = _bundle(cfg, [specs[r] for r in members])
        else:  # one bundle per worker, as wide as the worker
            size = specs[key].num_workers
            bundle = _bundle(cfg, [specs[key]], _width(cfg, key))
        _reserve(name, [bundle] * size, cfg.cluster.placement_strategy, cfg.cluster.placement_timeout_seconds)
        share = len(members)
        for r in members:
            spec = specs[r]
            step = _width(cfg, r) if cfg.cluster.colocate else 1
            out[r] = replace(
                spec,
                placement=Placement(name, tuple(i * step for i in range(spec.num_workers))),
                num_cpus=bundle["CPU"] / share,
                num_gpus=bundle.get("GPU", 0.0) / share,
                resources={k: v / share for k, v in spec.resources.items()},
            )
    return out


def pg_name(run: RunHandle, key: str) -> str:
    """Name of a run's placement group (`shared` when colocated, else the role)."""
    return f"{run.name}-{run.key}-pg-{key}"


def release(run: RunHandle) -> None:
    """Remove the run's placement groups (at the end of a run, and before a rebuild re-reserves them)."""
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


def _where(engine: object) -> dict[str, object]:
    """Runs inside a rank: its node address and the fake/real GPU ids Ray assigned it."""
    import os

    import ray

    ctx = ray.get_runtime_context()
    return {
        "node_ip": ray.util.get_node_ip_address(),
        "node_id": ctx.get_node_id(),
        "gpu_ids": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "local_rank": os.environ.get("LOCAL_RANK"),
    }


def report(groups: dict[str, ActorGroup], path: Path, timeout: float = 120.0) -> list[dict[str, object]]:
    """Where every rank of every group runs (node, GPU ids), appended to `path` as one JSON list per build
    (`placement.json` in the run dir: the latest build is the last entry)."""
    import ray

    rows: list[dict[str, object]] = []
    named = {id(g): (role, g) for role, g in groups.items()}  # a hybrid group (rollout is actor) once, as actor
    for role, group in named.values():
        if group.in_process:
            continue
        found = ray.get([h.__ray_call__.remote(_where) for h in group.handles], timeout=timeout)
        rows += [{"role": role, "rank": rank, **info} for rank, info in enumerate(found)]
    builds = json.loads(path.read_text()) if path.is_file() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([*builds, rows], indent=1))
    tmp.replace(path)
    return rows
