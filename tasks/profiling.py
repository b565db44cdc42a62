"""Stage profiles of the configured steps (`trainer.profile`): profilers in every worker of the stage's roles,
their files under the run directory's profiles/step_N/<stage>/<role>-<rank>/, logged to MLflow at the same path
and linked from a Prefect markdown artifact. Nothing happens (one membership test) for other steps and stages."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from prefect.artifacts import create_markdown_artifact

from rlstages.configs import RunConfig
from rlstages.engines.runtime import profiling
from rlstages.engines.workers.actor_group import ActorGroup
from rlstages.tasks import prefect_api
from rlstages.tasks.driver import tracking
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.workers import get_workers

log = logging.getLogger(__name__)

# The worker groups each profiled stage runs on (the hybrid engine's rollout is its actor group).
STAGE_ROLES: dict[str, tuple[str, ...]] = {
    "generate": ("rollout",),
    "score_rewards": ("reward", "reward_model"),
    "actor_logprobs": ("actor",),
    "ref_logprobs": ("reference",),
    "critic_values": ("critic",),
    "update_critic": ("critic",),
    "update_actor": ("actor",),
    "sync_weights": ("actor", "rollout"),
}


def due(cfg: RunConfig, stage: str, step: int) -> bool:
    """Whether `stage` of `step` is profiled."""
    profile = cfg.trainer.profile
    return step in profile.steps and stage in profile.stages


def _groups(cfg: RunConfig, run: RunHandle, stage: str) -> list[tuple[str, ActorGroup]]:
    workers = get_workers(run)
    named = workers.groups()
    picked: dict[int, tuple[str, ActorGroup]] = {}
    for role in STAGE_ROLES.get(stage, ()):
        group = named.get("actor" if (role == "rollout" and workers.hybrid) else role)
        if group is not None:
            picked.setdefault(id(group), (role, group))
    return list(picked.values())


@contextlib.contextmanager
def profiled(cfg: RunConfig, run: RunHandle, stage: str, step: int) -> Iterator[None]:
    """Profile the block in the workers of `stage` when `step` and `stage` are configured; else do nothing."""
    if not due(cfg, stage, step):
        yield
        return
    p = cfg.trainer.profile
    options = profiling.ProfileOptions(record_shapes=p.record_shapes, with_stack=p.with_stack, memory=p.memory)
    groups = _groups(cfg, run, stage)
    for _, group in groups:
        group.each(profiling.start, options)
    failed = True
    try:
        yield
        failed = False
    finally:
        try:
            save_profiles(cfg, run, stage, step, [(role, g.each(profiling.stop)) for role, g in groups])
        except Exception:  # noqa: BLE001 - a failing stage's own error wins; a profile is never worth a run
            if not failed:
                raise
            log.warning("profiles of %s at step %d not saved", stage, step, exc_info=True)


def save_profiles(
    cfg: RunConfig, run: RunHandle, stage: str, step: int, results: list[tuple[str, list[dict[str, bytes]]]]
) -> Path:
    """Write each worker's files, log them to MLflow under profiles/step_N/<stage>/, link them from Prefect."""
    rel = f"profiles/step_{step}/{stage}"
    out = run.path / rel
    written: list[str] = []
    for role, per_rank in results:
        for rank, files in enumerate(per_rank):
            for name, data in files.items():
                path = out / f"{role}-{rank}" / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                written.append(f"{role}-{rank}/{name}")
    run_id = run.mlflow_run_id()
    if not written:
        return out
    link = ""
    if run_id is not None:
        tracking.log_directory(cfg, run_id, out, rel)
        link = f"[MLflow run]({tracking.run_link(cfg, run_id)}), artifacts `{rel}/`\n\n"
    rows = "\n".join(f"| `{rel}/{w}` |" for w in sorted(written))
    prefect_api.best_effort(
        lambda: create_markdown_artifact(
            key=f"profile-step-{step}-{stage.replace('_', '-')}",
            markdown=f"### Profile of {stage} at step {step}\n\n{link}| file |\n|---|\n{rows}\n\n"
            "Open `trace.json` in ui.perfetto.dev or chrome://tracing; `memory_snapshot.pickle` in "
            "pytorch.org/memory_viz.",
            description=f"torch.profiler: {stage}, step {step}",
        ),
        "the profile artifact",
    )
    return out
