"""Actor groups on a real local Ray: named actors found again, dispatch modes, a dead actor detected and
rebuilt, and trainer -> rollout weight sync whose log-prob check stays under 1e-4 in fp32. CPU only."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlstages.engines import types as T
from rlstages.engines.runtime import profiling
from rlstages.engines.sync.buckets import bucketize, decode_bucket
from rlstages.engines.sync.in_process import InProcessSync
from rlstages.engines.sync.object_store import ObjectStoreSync
from rlstages.engines.sync.protocol import SyncRound
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams
from rlstages.engines.workers.actor_group import ActorGroup, GroupSpec

PROMPTS = [Prompt(f"u{i}", f"{i}+1=", str(i + 1)) for i in range(4)]


def setup_module() -> None:
    """Ship this module's helper class to Ray workers by value (test files are not importable there)."""
    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Echo:
    """A plain class standing in for an engine with a rank-dependent answer."""

    def __init__(self, tag: str = "x") -> None:
        self.tag = tag

    def rows(self, batch: TensorDict) -> TensorDict:
        return TensorDict({"x": batch["x"] * 10}, batch_size=batch.batch_size)

    def whoami(self) -> str:
        import os

        return f"{self.tag}:{os.getpid()}"

    def env(self, key: str) -> str | None:
        import os

        return os.environ.get(key)

    def mapped(self, part: str) -> bool:
        """Whether a file whose path contains `part` is mapped into this process (a preloaded library)."""
        with open("/proc/self/maps") as f:
            return any(part in line for line in f)


def rollout_spec(path: Path, name: str) -> GroupSpec:
    return GroupSpec(
        name=name,
        engine="rlstages.engines.rollout.hf_rollout:HFRolloutEngine",
        kwargs={"model_path": str(path), "dtype": "float32", "apply_chat_template": False},
    )


def trainer_spec(path: Path, name: str) -> GroupSpec:
    return GroupSpec(
        name=name,
        engine="rlstages.engines.training.core:PPOTrainer",
        kwargs={"settings": TrainerSettings(str(path))},
    )


def test_dispatch_modes_and_mesh(ray_session) -> None:
    spec = GroupSpec(name="echo", engine=f"{__name__}:Echo", num_workers=4, tp=2, pp=1)
    group = ActorGroup(spec, namespace="rlstages-tests")
    pids = group.all(120).whoami()  # 4 actors starting on a loaded 2-core machine
    assert len(set(pids)) == 4
    batch = TensorDict({"x": torch.arange(6)}, batch_size=[6])
    out = group.dp(30).rows(batch)  # dp=2: rows split in two, gathered from tp rank 0 of each dp group
    assert torch.equal(out["x"], torch.arange(6) * 10)
    assert group.collect_ranks() == [0, 2]
    assert spec.coords(3) == (1, 0, 1)
    assert group.one(0).env("OMP_WAIT_POLICY") == "PASSIVE"  # the process env, set before torch loads
    assert group.one(0).mapped("libjemalloc")  # the default allocator (`cluster.heap: jemalloc`), preloaded
    assert group.one(0).env("MALLOC_ARENA_MAX") == "1"
    again = ActorGroup(spec, namespace="rlstages-tests")  # a retried task finds the same named actors
    assert again.all(30).whoami() == pids
    # worker-side helpers through `each` (trainer.profile): a profiler per rank around a dispatched call
    assert group.each(profiling.start, profiling.ProfileOptions(memory=True), timeout=30) == [True] * 4
    group.dp(30).rows(batch)
    files = group.each(profiling.stop, timeout=60)
    assert [f"x:{json.loads(f['peak_rss.json'])['pid']}" for f in files] == pids  # each rank its own
    assert all(json.loads(f["trace.json"])["traceEvents"] for f in files)
    group.kill()


def test_a_coordinating_actor_asks_for_the_drivers_node(ray_session) -> None:
    import ray

    group = ActorGroup(GroupSpec(name="beside", engine=f"{__name__}:Echo", beside_driver=True), "rlstages-tests")
    where = group._options(0)["scheduling_strategy"]  # (the reward scorer's and the rollout queue's placement)
    assert (where.node_id, where.soft) == (ray.get_runtime_context().get_node_id(), False)
    assert group.one(0).whoami().startswith("x:")  # placed and running
    free = ActorGroup(GroupSpec(name="free", engine=f"{__name__}:Echo"), "rlstages-tests")
    assert "scheduling_strategy" not in free._options(0)  # (Ray's default placement for the rest)
    group.kill(), free.kill()


def test_rank_coordinates_are_megatron_cores() -> None:
    """The group sends a data-parallel replica's rows to the ranks megatron-core puts in that replica: with
    TP, PP and DP all > 1 a wrong order feeds one replica's stages different rows."""
    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    spec = GroupSpec(name="mesh", engine="x:Y", num_workers=8, tp=2, pp=2)
    ranks = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    for axis, index in (("dp", 0), ("pp", 1), ("tp", 2)):  # ranks that differ only along `axis`
        for group in ranks.get_ranks(axis):
            others = {tuple(c for i, c in enumerate(spec.coords(r)) if i != index) for r in group}
            assert len(others) == 1 and sorted(spec.coords(r)[index] for r in group) == list(range(2)), (axis, group)
    assert [spec.coords(r) for r in (2, 4)] == [(1, 0, 0), (0, 1, 0)]


def test_pp_as_dp_splits_over_pipeline_stages(ray_session) -> None:
    spec = GroupSpec(name="echo-pp", engine=f"{__name__}:Echo", num_workers=4, tp=2, pp=2)
    group = ActorGroup(spec, namespace="rlstages-tests")
    batch = TensorDict({"x": torch.arange(8)}, batch_size=[8])
    assert group.collect_ranks() == [2] and group.collect_ranks(pp_as_dp=True) == [0, 2]
    assert torch.equal(group.pp_as_dp(30).rows(batch)["x"], torch.arange(8) * 10)
    assert torch.equal(group.dp(30).rows(batch)["x"], torch.arange(8) * 10)
    group.kill()


def test_dead_actor_detected_and_rebuilt(ray_session) -> None:
    import ray

    group = ActorGroup(GroupSpec(name="echo-dead", engine=f"{__name__}:Echo", num_workers=2), "rlstages-tests")
    first = group.all(30).whoami()
    ray.kill(group.handles[1], no_restart=True)  # asynchronous: the actor may answer one more ping
    deadline = time.monotonic() + 30
    while group.alive(timeout=10) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group.alive(timeout=10)
    with pytest.raises(ray.exceptions.RayActorError):
        group.all(30).whoami()
    group.rebuild()
    assert group.alive() and group.all(30).whoami()[1] != first[1]
    group.kill()


def test_weight_sync_over_ray_keeps_logprobs_in_step(ray_session, tiny_model_dir: Path) -> None:
    rollout = ActorGroup(rollout_spec(tiny_model_dir, "sync-rollout"), "rlstages-tests")
    trainer = ActorGroup(trainer_spec(tiny_model_dir, "sync-trainer"), "rlstages-tests")
    params = SamplingParams(n=2, max_new_tokens=6)
    batch = rollout.dp(60).generate(PROMPTS, params, 0)
    batch[T.ADVANTAGES] = torch.randn(batch[T.RESPONSE_MASK].shape) * batch[T.RESPONSE_MASK]
    trainer.dp(60).train_step(batch)  # the trainer moves: the rollout engine is now stale
    stale = rollout.dp(60).generate(PROMPTS, params, 1)
    diff_stale = (
        (trainer.dp(60).logprobs(stale)["logprobs"] - stale[T.ROLLOUT_LOGPROBS]).abs() * stale[T.RESPONSE_MASK]
    ).max()
    metrics = ObjectStoreSync().push(SyncRound(trainer.handles, 0, rollout.handles, 1 << 16, "float32", timeout=60))
    assert metrics["sync/buckets"] > 1 and metrics["sync/tensors"] > 0
    fresh = rollout.dp(60).generate(PROMPTS, params, 1)
    diff = (trainer.dp(60).logprobs(fresh)["logprobs"] - fresh[T.ROLLOUT_LOGPROBS]).abs() * fresh[T.RESPONSE_MASK]
    assert diff.max() < 1e-4 < diff_stale
    rollout.kill()
    trainer.kill()


def test_buckets_round_trip_bf16_and_sizes(tiny_model_dir: Path) -> None:
    from rlstages.engines.training.core import PPOTrainer

    engine = PPOTrainer(TrainerSettings(str(tiny_model_dir)))
    weights = dict(engine.named_weights())
    buckets = list(bucketize(weights.items(), 1 << 15, "bfloat16"))
    assert len(buckets) > 2
    got = {name: t for b in buckets for name, t in decode_bucket(b)}
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[k], weights[k].to(torch.bfloat16)) for k in weights)


def test_in_process_group_runs_the_same_engines(tiny_model_dir: Path) -> None:
    rollout = ActorGroup(rollout_spec(tiny_model_dir, "local-rollout"), in_process=True)
    trainer = ActorGroup(trainer_spec(tiny_model_dir, "local-trainer"), in_process=True)
    out = rollout.dp().generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4), 0)
    assert out.batch_size[0] == 8
    metrics = InProcessSync().push(SyncRound(trainer.handles, 0, rollout.handles, 1 << 20, "float32", 60, True))
    assert metrics["sync/tensors"] == len(list(trainer.handles[0].named_weights()))
