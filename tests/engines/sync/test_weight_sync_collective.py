"""Collective weight sync (split placement) and the group rendezvous on a real local Ray: a broadcast group of
the trainer's rank and two rollout workers keeps log-probs within 1e-4 after every sync; rank 0 publishes the
rendezvous from its own process; LOCAL_RANK / LOCAL_WORLD_SIZE count ranks per node. CPU only (gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlstages.engines import types as T
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.runtime.device import worker_device
from rlstages.engines.runtime.payload import layout, pack_into, unpack
from rlstages.engines.runtime.rendezvous import collective_backend, local_ranks
from rlstages.engines.sync.collective.driver import CollectiveSync
from rlstages.engines.sync.protocol import SyncRound
from rlstages.engines.sync.shm_files import shm_dir
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams
from rlstages.engines.workers.actor_group import ActorGroup, GroupSpec

PROMPTS = [Prompt(f"u{i}", f"{i}+1=", str(i + 1)) for i in range(4)]


def setup_module() -> None:
    """Ship this module's helper class to Ray workers by value (test files are not importable there)."""
    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Ranked:
    """Joins the group's process group from the env the actor group set, and all-reduces its rank + 1."""

    def __init__(self) -> None:
        import os

        import torch.distributed as dist

        dist.init_process_group(collective_backend(worker_device()))
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        self.info = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
        self.info["sum"] = float(total)

    def report(self) -> dict:
        return self.info


class CopyingRollout(HFRolloutEngine):
    """The HF engine without `adopt_weights`: it receives as engines that can only copy do (vLLM, SGLang)."""

    adopt_weights = None


class TensorSource:
    """A weight source with no model: HF-named tensors of a fixed seed (the group logic needs nothing more)."""

    device = torch.device("cpu")  # the worker's device, as every engine is handed it where its worker starts

    def named_weights(self):
        g = torch.Generator().manual_seed(0)
        for i in range(6):
            yield f"model.layers.{i}.mlp.up_proj.weight", torch.randn(16, 24, generator=g)


class TensorSink:
    """A receiver with no model: keeps what it is handed, and the names in the order they came."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.received: list[str] = []

    def update_weights(self, named_tensors) -> None:
        for name, tensor in named_tensors:
            self.received.append(name)
            self.weights[name] = tensor.clone()

    def wake(self) -> None:
        pass


def _groups_here(engine) -> dict[str, int]:
    """The sync groups this actor holds: name -> its rank in it."""
    from rlstages.engines.sync.collective.membership import SYNC_GROUPS

    return {name: member.rank for name, member in SYNC_GROUPS.items()}


def _received(engine) -> tuple[list[str], dict[str, torch.Tensor]]:
    names, engine.received = engine.received, []
    return names, engine.weights


def _count(engine) -> int:
    return len(list(engine.named_weights()))


def _weight_files(engine) -> set[str | None]:
    """The files the rollout engine's weights are mapped from (None: its own memory)."""
    return {p.untyped_storage().filename for p in engine.model.parameters()}


def test_local_ranks_count_per_node() -> None:
    assert local_ranks(["a", "a", "b", "b", "a"]) == [(0, 3), (1, 3), (0, 2), (1, 2), (2, 3)]
    assert local_ranks([None, None]) == [(0, 2), (1, 2)]  # unknown nodes: one node assumed


def test_pack_round_trips_bf16_and_odd_shapes() -> None:
    named = [("a", torch.randn(3, 5)), ("b", torch.randn(7)[::2])]  # fp32, one of them non-contiguous
    meta, nbytes = layout(named, torch.bfloat16)
    payload = torch.empty(nbytes, dtype=torch.uint8)
    pack_into(named, torch.bfloat16, payload)  # the cast to the rollout dtype is the copy into the payload
    got = dict(unpack(meta, payload))
    assert list(got) == ["a", "b"] and nbytes == (15 + 4) * 2
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) and got[k].dtype == torch.bfloat16 for k, v in named)


def test_group_rendezvous_comes_from_rank_0(ray_session) -> None:
    group = ActorGroup(GroupSpec(name="ranked", engine=f"{__name__}:Ranked", num_workers=3), "rlstages-tests")
    try:
        infos = group.all(120).report()
        assert [i["sum"] for i in infos] == [6.0, 6.0, 6.0]  # the collective passed on every rank
        assert [i["RANK"] for i in infos] == ["0", "1", "2"]
        assert [i["LOCAL_WORLD_SIZE"] for i in infos] == ["3"] * 3
        assert len({i["MASTER_ADDR"] for i in infos}) == 1
    finally:
        group.kill()


@pytest.mark.parametrize("adopts", [True, False], ids=["adopting", "copying"])
def test_collective_sync_keeps_logprobs_in_step(ray_session, tiny_model_dir: Path, adopts: bool) -> None:
    rollout_spec = GroupSpec(
        name="csync-rollout",
        engine="rlstages.engines.rollout.hf_rollout:HFRolloutEngine" if adopts else f"{__name__}:CopyingRollout",
        kwargs={"model_path": str(tiny_model_dir), "dtype": "float32", "apply_chat_template": False},
        num_workers=2,
    )
    trainer_spec = GroupSpec(
        name="csync-trainer",
        engine="rlstages.engines.training.core:PPOTrainer",
        kwargs={"settings": TrainerSettings(str(tiny_model_dir))},
    )
    rollout = ActorGroup(rollout_spec, "rlstages-tests")
    trainer = ActorGroup(trainer_spec, "rlstages-tests")
    sync = CollectiveSync()
    params = SamplingParams(n=2, max_new_tokens=6)
    try:
        for step in range(2):  # every sync, not only the first, leaves the rollout in step with the trainer
            batch = rollout.dp(120).generate(PROMPTS, params, step)
            batch[T.ADVANTAGES] = torch.randn(batch[T.RESPONSE_MASK].shape) * batch[T.RESPONSE_MASK]
            trainer.dp(120).train_step(batch)
            stale = rollout.dp(120).generate(PROMPTS, params, 10 + step)
            diff_stale = (trainer.dp(120).logprobs(stale)["logprobs"] - stale[T.ROLLOUT_LOGPROBS]).abs()
            metrics = sync.push(SyncRound(trainer.handles, 0, rollout.handles, 1 << 15, "float32", 120))
            assert metrics["sync/buckets"] > 1
            assert metrics["sync/shared_memory"] == 1.0  # one node: payloads pass through shared memory
            assert not list(shm_dir().glob("rlstages-wsync-*"))  # its file is unlinked once all have mapped it
            assert metrics["sync/tensors"] == ray_session.get(
                trainer.handles[0].__ray_call__.remote(_count), timeout=60
            )
            # the HF engines adopted the file's regions as their weights: the sync's cast was the only copy, and
            # the two workers on this node share one copy of the weights (the first sync grows the file, so its
            # early buckets sit in smaller files; from the second on, all fit in one)
            files = ray_session.get([h.__ray_call__.remote(_weight_files) for h in rollout.handles], timeout=60)
            if adopts:
                assert files[0] == files[1] and (len(files[0]) == 1 or step == 0)
                assert all(f is not None and f.startswith(str(shm_dir() / "rlstages-wsync-")) for f in files[0])
            else:  # copied out of the file once the source had written it (checked by the log-probs below)
                assert files == [{None}, {None}]
            fresh = rollout.dp(120).generate(PROMPTS, params, 10 + step)
            diff = (trainer.dp(120).logprobs(fresh)["logprobs"] - fresh[T.ROLLOUT_LOGPROBS]).abs()
            mask = fresh[T.RESPONSE_MASK]
            assert (diff * mask).max() < 1e-4 < (diff_stale * stale[T.RESPONSE_MASK]).max()
        assert len(sync._groups) == 1  # one broadcast group, reused by the second sync
    finally:
        rollout.kill()
        trainer.kill()


def test_group_ranks_order_and_rejoin_after_a_rollout_worker_is_replaced(ray_session) -> None:
    """The group logic NCCL runs on GPUs, over gloo with the payload broadcast (no shared memory): the source is
    rank 0 and the rollout workers follow in order; every receiver gets the source's tensors in the order of its
    `named_weights`, bucket after bucket, bit-exact; when a worker is replaced the next sync forms a new group of
    the live actors, the survivor drops the old one, and the newcomer receives everything."""
    import time

    import ray

    source = ActorGroup(GroupSpec(name="rejoin-source", engine=f"{__name__}:TensorSource"), "rlstages-tests")
    sinks = ActorGroup(GroupSpec(name="rejoin-sinks", engine=f"{__name__}:TensorSink", num_workers=3), "rlstages-tests")
    want = dict(TensorSource().named_weights())
    sync = CollectiveSync(shared_memory=False)
    try:
        first = sync.push(SyncRound(source.handles, 0, sinks.handles[:2], 500, "bfloat16", 120))
        assert first["sync/shared_memory"] == 0.0 and first["sync/buckets"] == 6 and first["sync/tensors"] == 6
        (old_name,) = ray.get(source.handles[0].__ray_call__.remote(_groups_here), timeout=60)
        assert ray.get([h.__ray_call__.remote(_groups_here) for h in sinks.handles[:2]], timeout=60) == [
            {old_name: 1},
            {old_name: 2},
        ]
        for names, got in ray.get([h.__ray_call__.remote(_received) for h in sinks.handles[:2]], timeout=60):
            assert names == list(want)  # the source's order
            assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in want.items())  # bf16 buckets, exact

        ray.kill(sinks.handles[1])  # a worker is lost; the third sink stands in for its replacement
        live = [sinks.handles[0], sinks.handles[2]]
        second = sync.push(SyncRound(source.handles, 0, live, 500, "bfloat16", 120))
        assert second["sync/buckets"] == 6
        (new_name,) = ray.get(source.handles[0].__ray_call__.remote(_groups_here), timeout=60)
        assert new_name != old_name and len(sync._groups) == 1
        for _ in range(50):  # the survivor drops the old group (fire and forget)
            if ray.get(live[0].__ray_call__.remote(_groups_here), timeout=60) == {new_name: 1}:
                break
            time.sleep(0.1)
        assert ray.get([h.__ray_call__.remote(_groups_here) for h in live], timeout=60) == [
            {new_name: 1},
            {new_name: 2},
        ]
        for names, got in ray.get([h.__ray_call__.remote(_received) for h in live], timeout=60):
            assert names == list(want)
            assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in want.items())
    finally:
        source.kill()
        sinks.kill()
