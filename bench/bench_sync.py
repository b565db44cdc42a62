"""Trainer -> rollout weight sync vs a plain in-process state-dict copy of the same weights into a model of the
rollout dtype (goal: ratio <= 2.0). Two layouts: the hybrid engine (trainer and rollout in one worker, the
colocated default of `cluster.hybrid_engine`) and split workers (bucketed numpy through Ray's object store).
`python -m bench.bench_sync`"""

from __future__ import annotations

from pathlib import Path

import ray
import torch

from bench.common import best_of, report, small_model
from rlstages.engines.runtime.actor_group import ActorGroup, GroupSpec
from rlstages.engines.runtime.weight_sync import sync_weights_ray
from rlstages.engines.training.core import PPOTrainer
from rlstages.engines.training.settings import TrainerSettings

TRAINER = "rlstages.engines.training.core:PPOTrainer"
ROLLOUT = "rlstages.engines.rollout.hf_rollout:HFRolloutEngine"


def _group(name: str, engine: str, **kwargs: object) -> ActorGroup:
    return ActorGroup(GroupSpec(name=name, engine=engine, kwargs=dict(kwargs)), "bench")


def measure(path: Path, local: PPOTrainer, dtype: str) -> list[tuple[str, float, float, str]]:
    """Rows for one rollout dtype: hybrid (inside the worker, and including the Ray call) and split workers."""
    model = local.backend.model  # type: ignore[attr-defined]
    params = sum(p.numel() for p in model.parameters()) / 1e6
    rollout_kwargs = {"model_path": str(path), "dtype": dtype, "apply_chat_template": False}
    trainer = _group(f"bench-trainer-{dtype}", TRAINER, settings=TrainerSettings(str(path)))
    rollout = _group(f"bench-rollout-{dtype}", ROLLOUT, **rollout_kwargs)
    hybrid = _group(
        f"bench-hybrid-{dtype}",
        "rlstages.engines.runtime.hybrid:HybridEngine",
        trainer=TRAINER,
        trainer_kwargs={"settings": TrainerSettings(str(path))},
        rollout=ROLLOUT,
        rollout_kwargs=rollout_kwargs,
    )
    split = best_of(lambda: sync_weights_ray(trainer.handles, 0, rollout.handles, 256 << 20, dtype, 600))
    with_call = best_of(lambda: ray.get(hybrid.handles[0].sync_local.remote()))
    inner = ray.get(hybrid.handles[0].sync_local.remote())["timing/sync_weights_s"]
    target = {k: v.to(getattr(torch, dtype), copy=True) for k, v in model.state_dict().items()}

    def state_dict_copy() -> None:
        for name, tensor in model.state_dict().items():
            target[name].copy_(tensor)

    base = best_of(state_dict_copy)
    for group in (trainer, rollout, hybrid):
        group.kill()
    return [
        (f"hybrid engine (in the worker), {params:.0f}M, {dtype}", inner, base, "<= 2.0"),
        (f"hybrid engine (incl. Ray call), {params:.0f}M, {dtype}", with_call, base, "<= 2.0"),
        (f"split workers via Ray, {params:.0f}M, {dtype}", split, base, "(none)"),
    ]


def main(hidden: int = 512, layers: int = 8, vocab: int = 16384) -> None:
    """Sync a ~40M-parameter model into fp32 and bf16 rollout engines."""
    torch.set_num_threads(1)
    path = small_model(hidden, layers, vocab, name="bench-sync")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    local = PPOTrainer(TrainerSettings(str(path)))
    rows = measure(path, local, "float32") + measure(path, local, "bfloat16")
    report("weight sync vs in-process state-dict copy (ratio = ours / baseline)", rows)
    ray.shutdown()


if __name__ == "__main__":
    main()
