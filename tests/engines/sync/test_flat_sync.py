"""Split placement's collective sync into engines that form the broadcast group with their own API (SGLang's
`init_weights_update_group` and `update_weights_from_distributed(load_format="flattened_bucket")`), on a real
local Ray over gloo: the driver opens and closes each engine's session, the source sends each bucket's layout
through Ray and broadcasts it flat, and the rollout keeps log-probs within 1e-4 of the trainer after every sync.

SGLang itself cannot run here (no CPU build). Its receiving side is a few torch calls, so the receiver below is
the HF engine receiving as SGLang's workers do: where SGLang's own modules import (a GPU machine, or
`pip install --no-deps sglang` plus the modules `sglang.srt.utils.common` imports), it forms the group with
SGLang's `init_custom_process_group` and unpacks with SGLang's `FlattenedTensorBucket`, which checks the source's
group and payload against SGLang's code; elsewhere (CI) it forms the group with `sync.collective.flat.join_flat_group`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlstages.engines import types as T
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.sync.collective.driver import CollectiveSync
from rlstages.engines.sync.protocol import SyncRound
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams
from rlstages.engines.workers.actor_group import ActorGroup, GroupSpec

PROMPTS = [Prompt(f"u{i}", f"{i}+1=", str(i + 1)) for i in range(4)]


def setup_module() -> None:
    """Ship this module's receiver class to Ray workers by value (test files are not importable there)."""
    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def sglang_receiver() -> tuple[Any, Any] | None:
    """SGLang's group factory and flat bucket, where its modules import here."""
    try:
        from sglang.srt.utils.common import init_custom_process_group
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError:
        return None
    return init_custom_process_group, FlattenedTensorBucket


class FlatRollout(HFRolloutEngine):
    """The HF engine receiving as SGLang's workers do (see the module doc); counts its sessions."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups: dict[str, Any] = {}
        self.sessions = {"begin": 0, "end": 0, "buckets": 0}
        self.receiver = "sglang" if sglang_receiver() else "torch"

    def weight_group_size(self) -> int:
        return 1

    def join_weight_group(self, name, addr, port, rank, world, timeout, shm_path, host) -> None:  # noqa: ANN001
        sglang = sglang_receiver()
        if sglang is not None:
            init = f"tcp://{addr}:{port}"
            self.groups[name] = sglang[0](
                backend="gloo", init_method=init, world_size=world, rank=rank, group_name=name
            )
        else:
            from rlstages.engines.sync.collective.flat import join_flat_group

            self.groups[name] = join_flat_group(name, addr, port, rank, world, timeout, torch.device("cpu"))

    def begin_weight_group_update(self, name: str) -> None:
        self.wake()
        self.sessions["begin"] += 1

    def receive_weight_bucket(self, name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> int:
        import torch.distributed as dist

        assert self.sessions["begin"] == self.sessions["end"] + 1, "a bucket outside a weight-update session"
        sglang = sglang_receiver()
        if sglang is not None:
            bucket = sglang[1].empty(names, dtypes, shapes, "cpu")
            dist.broadcast(bucket.get_flattened_tensor(), src=0, group=self.groups[name])
            named = bucket.reconstruct_tensors()
        else:
            kinds = [getattr(torch, d) for d in dtypes]
            sizes = [torch.Size(s).numel() * k.itemsize for s, k in zip(shapes, kinds, strict=True)]
            flat = torch.empty(sum(sizes), dtype=torch.uint8)
            dist.broadcast(flat, src=0, group=self.groups[name])
            parts = flat.split(sizes)
            named = [(n, p.view(k).view(s)) for n, p, k, s in zip(names, parts, kinds, shapes, strict=True)]
        self.update_weights(named)
        self.sessions["buckets"] += 1
        return len(names)

    def end_weight_group_update(self, name: str) -> None:
        self.sessions["end"] += 1

    def leave_weight_group(self, name: str) -> None:
        self.groups.pop(name, None)


def _sessions(engine: FlatRollout) -> dict[str, Any]:
    return {**engine.sessions, "receiver": engine.receiver}


def test_flat_bucket_sync_keeps_logprobs_in_step(ray_session, tiny_model_dir: Path) -> None:
    rollout = ActorGroup(
        GroupSpec(
            name="fsync-rollout",
            engine=f"{__name__}:FlatRollout",
            kwargs={"model_path": str(tiny_model_dir), "dtype": "float32", "apply_chat_template": False},
            num_workers=2,
        ),
        "rlstages-tests",
    )
    trainer = ActorGroup(
        GroupSpec(
            name="fsync-trainer",
            engine="rlstages.engines.training.core:PPOTrainer",
            kwargs={"settings": TrainerSettings(str(tiny_model_dir))},
        ),
        "rlstages-tests",
    )
    sync = CollectiveSync()
    params = SamplingParams(n=2, max_new_tokens=6)
    try:
        for step in range(2):
            batch = rollout.dp(120).generate(PROMPTS, params, step)
            batch[T.ADVANTAGES] = torch.randn(batch[T.RESPONSE_MASK].shape) * batch[T.RESPONSE_MASK]
            trainer.dp(120).train_step(batch)
            stale = rollout.dp(120).generate(PROMPTS, params, 10 + step)
            diff_stale = (trainer.dp(120).logprobs(stale)["logprobs"] - stale[T.ROLLOUT_LOGPROBS]).abs()
            metrics = sync.push(SyncRound(trainer.handles, 0, rollout.handles, 1 << 15, "float32", 120))
            assert metrics["sync/buckets"] > 1 and metrics["sync/shared_memory"] == 0.0  # flat: always broadcast
            fresh = rollout.dp(120).generate(PROMPTS, params, 10 + step)
            diff = (trainer.dp(120).logprobs(fresh)["logprobs"] - fresh[T.ROLLOUT_LOGPROBS]).abs()
            mask = fresh[T.RESPONSE_MASK]
            assert (diff * mask).max() < 1e-4 < (diff_stale * stale[T.RESPONSE_MASK]).max()
        sessions = ray_session.get([h.__ray_call__.remote(_sessions) for h in rollout.handles], timeout=60)
        print("receivers:", {s["receiver"] for s in sessions})
        for s in sessions:  # one session per sync, every bucket inside one
            assert s["begin"] == s["end"] == 2 and s["buckets"] == 2 * metrics["sync/buckets"]
        assert len(sync._groups) == 1
    finally:
        rollout.kill()
        trainer.kill()
