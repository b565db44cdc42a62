"""Trainer -> rollout weight sync vs a plain in-process state-dict copy of the same weights into a model of the
rollout dtype (goal: ratio <= 2.0). Two layouts: the hybrid engine (trainer and rollout in one worker, the
colocated default of `cluster.hybrid_engine`) and split workers (bucketed numpy through Ray's object store).
`python -m bench.bench_sync`"""

from __future__ import annotations

import os

import ray
import torch

from bench.common import best_of, report, small_model
from engines.actor_group import ActorGroup, GroupSpec
from engines.training.torch_trainer import TorchTrainingEngine
from engines.weight_sync import sync_weights_ray


def main(hidden: int = 512, layers: int = 8, vocab: int = 16384) -> None:
    """Sync a ~40M-parameter model in fp32 and bf16."""
    torch.set_num_threads(1)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    path = small_model(hidden, layers, vocab, name="bench-sync")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    local = TorchTrainingEngine(path)
    params = sum(p.numel() for p in local.model.parameters())
    for dtype in ("float32", "bfloat16"):
        trainer = ActorGroup(
            GroupSpec(
                name=f"bench-trainer-{dtype}",
                engine="engines.training.torch_trainer:TorchTrainingEngine",
                kwargs={"model_path": str(path)},
            ),
            "bench",
        )
        rollout = ActorGroup(
            GroupSpec(
                name=f"bench-rollout-{dtype}",
                engine="engines.rollout.hf_rollout:HFRolloutEngine",
                kwargs={"model_path": str(path), "dtype": dtype, "apply_chat_template": False},
            ),
            "bench",
        )
        ours = best_of(lambda: sync_weights_ray(trainer.handles[0], rollout.handles, 256 << 20, dtype, 600))
        hybrid = ActorGroup(
            GroupSpec(
                name=f"bench-hybrid-{dtype}",
                engine="engines.hybrid:HybridEngine",
                kwargs={
                    "trainer": "engines.training.torch_trainer:TorchTrainingEngine",
                    "trainer_kwargs": {"model_path": str(path)},
                    "rollout": "engines.rollout.hf_rollout:HFRolloutEngine",
                    "rollout_kwargs": {"model_path": str(path), "dtype": dtype, "apply_chat_template": False},
                },
            ),
            "bench",
        )
        in_process = best_of(lambda: ray.get(hybrid.handles[0].sync_local.remote()))
        hybrid_inner = ray.get(hybrid.handles[0].sync_local.remote())["timing/sync_weights_s"]
        target = {k: v.to(getattr(torch, dtype), copy=True) for k, v in local.model.state_dict().items()}

        def state_dict_copy() -> None:
            for name, tensor in local.model.state_dict().items():
                target[name].copy_(tensor)

        base = best_of(state_dict_copy)
        rows.append((f"hybrid engine (in the worker), {params / 1e6:.0f}M, {dtype}", hybrid_inner, base, "<= 2.0"))
        rows.append((f"hybrid engine (incl. Ray call), {params / 1e6:.0f}M, {dtype}", in_process, base, "<= 2.0"))
        rows.append((f"split workers via Ray, {params / 1e6:.0f}M, {dtype}", ours, base, "(no goal)"))
        hybrid.kill()
        trainer.kill()
        rollout.kill()
    report("weight sync (Ray actors) vs in-process state-dict copy", rows)
    ray.shutdown()


if __name__ == "__main__":
    main()
