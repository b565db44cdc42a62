"""Driver scenarios run as a subprocess against the simulated cluster (RAY_ADDRESS + token in the env), so the
pytest process's own local Ray is never touched. `python sim_driver.py SCENARIO MODEL_DIR` prints one JSON line.

- spanning: a 4-rank group over both worker nodes (2 fake GPUs each, pinned by the nodes' custom resources)
  joins its process group from rank 0's rendezvous and all-reduces; reports where each rank ran.
- sync: a torch trainer on node 1, two HF rollout workers on node 2; train, collective sync, log-prob diff.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import ray
import torch

from rlstages.engines import types as T
from rlstages.engines.runtime.device import worker_device
from rlstages.engines.runtime.rendezvous import collective_backend
from rlstages.engines.sync.collective.driver import CollectiveSync
from rlstages.engines.sync.protocol import SyncRound
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams
from rlstages.engines.workers.actor_group import ActorGroup, GroupSpec, Placement

NS = "rlstages-sim"


class Ranked:
    """Joins the group's process group (env from the actor group) and all-reduces rank + 1."""

    def __init__(self) -> None:
        import torch.distributed as dist

        dist.init_process_group(collective_backend(worker_device()))
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME")
        self.info: dict[str, Any] = {k: os.environ.get(k) for k in keys}
        self.info.update(sum=float(total), ip=ray.util.get_node_ip_address(), cuda=torch.cuda.is_available())

    def report(self) -> dict[str, Any]:
        return self.info


def spanning() -> dict[str, Any]:
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = [{"CPU": 0.25, "GPU": 1.0, f"sim_node_{1 + i // 2}": 0.25} for i in range(4)]
    pg = placement_group(bundles, strategy="PACK", name="sim-spanning")
    ray.get(pg.ready(), timeout=120)
    spec = GroupSpec(
        name="sim-spanning",
        engine="__main__:Ranked",
        num_workers=4,
        num_cpus=0.25,
        num_gpus=1.0,
        placement=Placement("sim-spanning", (0, 1, 2, 3)),
    )
    group = ActorGroup(spec, NS)
    try:
        return {"ranks": group.all(300).report(), "driver_ip": ray.util.get_node_ip_address()}
    finally:
        group.kill()
        remove_placement_group(pg)


def sync(model: str) -> dict[str, Any]:
    prompts = [Prompt(f"u{i}", f"{i}+1=", str(i + 1)) for i in range(4)]
    trainer = ActorGroup(
        GroupSpec(
            name="sim-trainer",
            engine="rlstages.engines.training.core:PPOTrainer",
            kwargs={"settings": TrainerSettings(model)},
            num_gpus=1.0,
            resources={"sim_node_1": 0.25},
        ),
        NS,
    )
    rollout = ActorGroup(
        GroupSpec(
            name="sim-rollout",
            engine="rlstages.engines.rollout.hf_rollout:HFRolloutEngine",
            kwargs={"model_path": model, "dtype": "float32", "apply_chat_template": False},
            num_workers=2,
            num_gpus=1.0,
            resources={"sim_node_2": 0.25},
        ),
        NS,
    )
    params = SamplingParams(n=2, max_new_tokens=6)
    transport = CollectiveSync()
    out: dict[str, Any] = {"diffs": [], "stale": []}
    try:
        out["trainer_ip"] = trainer.one(0, 120).__ray_call__(lambda e: ray.util.get_node_ip_address())
        out["rollout_ips"] = rollout.all(120).__ray_call__(lambda e: ray.util.get_node_ip_address())
        for step in range(2):
            batch = rollout.dp(300).generate(prompts, params, step)
            noise = torch.randn(batch[T.RESPONSE_MASK].shape, generator=torch.Generator().manual_seed(step))
            batch[T.ADVANTAGES] = noise * batch[T.RESPONSE_MASK]
            trainer.dp(300).train_step(batch)
            stale = rollout.dp(300).generate(prompts, params, 10 + step)
            d = (trainer.dp(300).logprobs(stale)["logprobs"] - stale[T.ROLLOUT_LOGPROBS]).abs() * stale[T.RESPONSE_MASK]
            out["stale"].append(float(d.max()))
            out["metrics"] = transport.push(SyncRound(trainer.handles, 0, rollout.handles, 1 << 15, "float32", 300))
            fresh = rollout.dp(300).generate(prompts, params, 10 + step)
            d = (trainer.dp(300).logprobs(fresh)["logprobs"] - fresh[T.ROLLOUT_LOGPROBS]).abs() * fresh[T.RESPONSE_MASK]
            out["diffs"].append(float(d.max()))
        return out
    finally:
        trainer.kill()
        rollout.kill()


def short() -> dict[str, Any]:
    """A layout the cluster cannot hold: the clear error, in bounded time."""
    from rlstages.tasks.driver.placement import _reserve

    try:
        _reserve("sim-short", [{"CPU": 0.1, "GPU": 4.0}] * 3, "PACK", 5)  # infeasible at once: no need to wait long
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


if __name__ == "__main__":
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address=os.environ["RAY_ADDRESS"], namespace=NS, log_to_driver=False, logging_level="ERROR")
    scenario = sys.argv[1]
    result = {"spanning": spanning, "short": short}[scenario]() if scenario != "sync" else sync(sys.argv[2])
    print(json.dumps(result))
