"""Placement groups on a real local Ray: colocated roles share bundle i, split roles get their own group,
and an impossible layout is a fast, clear error instead of a hang. CPU only."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlstages.configs import load_config
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.placement import pg_name
from rlstages.tasks.driver.workers import build_workers, forget_workers

ROOT = Path(__file__).resolve().parents[3]


def cfg_for(tmp: Path, model: Path, *overrides: str):
    return load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"model.path={model}",
            "model.provider=local",
            f"trainer.output_dir={tmp}",
            "cluster.placement_group=true",
            "cluster.cpus_per_bundle=0.5",
            "cluster.placement_timeout_seconds=5",
            *overrides,
        ],
    )


def placement(ray, handle) -> tuple[str, int]:
    def where(engine):  # runs inside the actor
        import ray as r

        ctx = r.get_runtime_context()
        return ctx.get_placement_group_id(), ctx.get_assigned_resources()

    pg, resources = ray.get(handle.__ray_call__.remote(where), timeout=60)
    return pg, resources


def test_colocated_roles_share_a_bundle(tmp_path: Path, tiny_model_dir: Path, ray_session) -> None:
    ray = ray_session
    cfg = cfg_for(tmp_path, tiny_model_dir)
    run = RunHandle("placed", str(tmp_path / "placed"))
    workers = build_workers(cfg, run)
    try:
        actor_pg, actor_res = placement(ray, workers.actor.handles[0])
        rollout_pg, rollout_res = placement(ray, workers.rollout.handles[0])
        shared = ray.util.get_placement_group(pg_name(run, "shared"))
        assert actor_pg == rollout_pg == shared.id.hex()
        assert actor_res["CPU"] == pytest.approx(0.25) and rollout_res["CPU"] == pytest.approx(0.25)
        assert placement(ray, workers.reward.handles[0])[0] is None  # the scorer is not reserved
    finally:
        forget_workers(run)
    with pytest.raises(ValueError):
        ray.util.get_placement_group(pg_name(run, "shared"))  # released with the workers


def test_split_roles_get_their_own_groups(tmp_path: Path, tiny_model_dir: Path, ray_session) -> None:
    ray = ray_session
    run = RunHandle("split", str(tmp_path / "split"))
    workers = build_workers(cfg_for(tmp_path, tiny_model_dir, "cluster.colocate=false"), run)
    try:
        actor_pg, _ = placement(ray, workers.actor.handles[0])
        rollout_pg, _ = placement(ray, workers.rollout.handles[0])
        assert actor_pg != rollout_pg
        assert actor_pg == ray.util.get_placement_group(pg_name(run, "actor")).id.hex()
    finally:
        forget_workers(run)


def test_impossible_layout_fails_fast(tmp_path: Path, tiny_model_dir: Path, ray_session) -> None:
    run = RunHandle("too-big", str(tmp_path / "too-big"))
    with pytest.raises(ValueError, match="cannot reserve 1 bundles"):
        build_workers(cfg_for(tmp_path, tiny_model_dir, "cluster.cpus_per_bundle=64"), run)
    forget_workers(run)
