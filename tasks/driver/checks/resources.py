"""Pre-flight resource discovery: the GPUs and CPUs of the cluster a run's workers will use, when they are known
before the start, and the check that `cluster.num_gpus` and the placement groups' CPUs fit there."""

from __future__ import annotations

import os
import sys

from rlstages.configs import RunConfig
from rlstages.tasks.driver.checks import PreflightError


def known_resources(cfg: RunConfig) -> tuple[float, float, str] | None:
    """(GPUs, CPUs, where) of the cluster the run's workers will use, when known before the start: the Ray this
    process already joined, a local Ray the run starts (this machine's GPUs; `cluster.num_cpus` or its CPUs),
    or this process (in_process). None for a cluster joined by address: its placement says
    (`tasks.driver.placement`)."""
    ray = sys.modules.get("ray")
    if cfg.cluster.mode == "ray" and ray is not None and ray.is_initialized():  # start_ray keeps that one
        total = ray.cluster_resources()
        return total.get("GPU", 0.0), total.get("CPU", 0.0), "the Ray this process joined"
    if cfg.cluster.mode == "ray" and (cfg.cluster.address or os.environ.get("RAY_ADDRESS")):
        return None
    cpus = float(cfg.cluster.num_cpus or os.cpu_count() or 1)
    if cfg.cluster.mode == "in_process":
        return float(local_gpu_count()) if cfg.cluster.num_gpus else 0.0, cpus, "this process (cluster.mode=in_process)"
    where = "a local Ray: no cluster.address or RAY_ADDRESS"
    if cfg.cluster.num_cpus:
        where += f"; cluster.num_cpus={cfg.cluster.num_cpus}"
    return float(local_gpu_count()) if cfg.cluster.num_gpus else 0.0, cpus, where


def local_gpu_count() -> int:
    """GPUs a Ray started on this machine would see (`engines.runtime.device.visible_gpus`)."""
    from rlstages.engines.runtime.device import visible_gpus

    return visible_gpus()


def check_cluster_resources(cfg: RunConfig) -> None:
    """When the cluster's resources are known before the start (`known_resources`): `cluster.num_gpus` GPUs
    exist there, and the CPUs the placement groups reserve fit."""
    c = cfg.cluster
    known = known_resources(cfg)
    if known is None:
        return
    gpus, cpus, where = known
    if c.num_gpus > gpus:
        raise PreflightError(
            f"cluster.num_gpus: {c.num_gpus} GPUs asked for, but the workers run where there are {gpus:g} "
            f"({where}); lower cluster.num_gpus or join a cluster that has them"
        )
    if c.mode == "ray" and c.use_placement_group:
        from rlstages.tasks.driver.placement import reserved_bundles

        bundles = reserved_bundles(cfg)
        need = bundles * c.cpus_per_bundle
        if need > cpus + 1e-9:
            raise PreflightError(
                f"cluster.cpus_per_bundle: the placement groups reserve {need:g} CPUs ({bundles} x "
                f"{c.cpus_per_bundle:g} per bundle) but the workers run where there are {cpus:g} ({where}); "
                "lower cluster.cpus_per_bundle or the worker counts"
            )
