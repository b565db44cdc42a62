"""The elastic rollout fleet of an async run (docs/async.md, "Elastic fleet"): between two steps, with no generation
in flight, the rollout group is brought to the size the run asks for (`cluster.mode: ray`, split placement).

    rescale(step):  ranks whose node is gone (ray.nodes) or whose actor died -> removed   (worker_leave, node_lost)
                    more ranks than asked for (`rlstages scale`)            -> last removed (worker_leave, scale)
                    fewer, and a free bundle of the rollout placement group on a live node, or free resources on
                    some node                                               -> one started, the trainer's weights
                                                                               pushed to it alone and its version
                                                                               stamped, then it joins (worker_join)
    heal(step):     a rank died during a generation -> removed; the step's prompts go to the survivors
    drop_lost(step): a weight sync failed: the ranks Ray reports dead (their node, or the actor) -> removed; the
                    sync is pushed again to the rest (no generation is in flight during a sync)

Called where the trainer's weights are the rollout engines' version (right after a sync, and at the feed's start),
so a joiner starts at the current policy version. The queue's admission counts prompt groups, not workers, so the
staleness bound eta holds whatever the fleet's size.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

from rlstages.configs import RunConfig
from rlstages.engines.rollout.streaming import stamp_version
from rlstages.engines.sync.protocol import SyncRound
from rlstages.engines.workers.actor_group import ActorGroup
from rlstages.engines.workers.elastic import add_rank, names, remove_rank
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.fleet_control import record, requested
from rlstages.tasks.driver.workers import get_workers
from rlstages.tasks.policies import WorkerLost, is_worker_death, stage_logger

BUCKET_BYTES = 256 << 20
LOST_WAIT_S = 90.0  # how long a failed sync waits for Ray to report the worker it lost (node death detection)
_IDS = itertools.count()  # joiner ids, never reused in this process


def elastic(cfg: RunConfig) -> bool:
    """True where the rollout fleet can change size: Ray, rollout workers of their own (not the hybrid engine)."""
    return cfg.cluster.mode == "ray" and not cfg.cluster.hybrid_engine


class Fleet:
    """The rollout group of one run kept at the asked-for size; join and leave events recorded."""

    def __init__(self, cfg: RunConfig, run: RunHandle) -> None:
        """Start from the configured `rollout.num_workers` (the control file, once read, overrides it)."""
        self.cfg, self.run = cfg, run
        self.wanted = cfg.rollout.num_workers
        self.where: dict[str, str] = {}  # actor name -> node id
        group = self.group
        self.pg = group.spec.placement.group_name  # the rollout placement group (None without one)
        self.bundles = dict(zip(names(group), group.spec.placement.bundle_indices, strict=False))  # name -> bundle
        self.joined = self.left = 0  # since the last `counts`

    @property
    def group(self) -> ActorGroup:
        """The run's live rollout group."""
        return get_workers(self.run).rollout

    def _nodes(self) -> None:
        """Learn the node of every rank not yet known (a rank that does not answer is left to `_gone`)."""
        import ray

        group = self.group
        for name, handle in zip(names(group), group.handles, strict=True):
            if name not in self.where:
                try:
                    self.where[name] = ray.get(handle.__ray_call__.remote(_node_id), timeout=60)
                except Exception as exc:  # noqa: BLE001 - dead or unreachable: `_gone` removes it
                    if not (is_worker_death(exc) or type(exc).__name__ == "GetTimeoutError"):
                        raise

    def _gone(self) -> list[tuple[int, str]]:
        """Ranks on a node Ray says is dead (`node_lost`), or whose actor does not answer (`died`)."""
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        group, out = self.group, []
        for i, name in enumerate(names(group)):
            if name in self.where and self.where[name] not in alive:
                out.append((i, "node_lost"))
                continue
            try:
                ray.get(group.handles[i].__ray_ready__.remote(), timeout=30)
            except Exception as exc:  # noqa: BLE001 - a dead actor (or one that cannot answer) leaves
                if not (is_worker_death(exc) or type(exc).__name__ == "GetTimeoutError"):
                    raise
                out.append((i, "died"))
        return out

    def _event(self, kind: str, name: str, step: int, version: int, reason: str) -> None:
        event = {
            "kind": kind,
            "worker": name,
            "node": self.where.get(name, ""),
            "step": step,
            "policy_version": version,
            "reason": reason,
            "rollout_workers": len(self.group.handles),
            "time": time.time(),
        }
        record(self.run.path, event)
        if kind == "worker_join":
            self.joined += 1
        else:
            self.left += 1
        stage_logger().info(f"fleet: {kind} {name} ({reason}) at step {step}, version {version}: "
                            f"{event['rollout_workers']} rollout workers")  # fmt: skip

    def _remove(self, index: int, step: int, version: int, reason: str) -> None:
        name = remove_rank(self.group, index)
        self._event("worker_leave", name, step, version, reason)
        self.where.pop(name, None)
        self.bundles.pop(name, None)  # its bundle (if any) stays reserved, free for a joiner

    def _free_bundle(self) -> int | None:
        """A bundle of the rollout placement group that no rank uses, placed on a live node (Ray re-places the
        bundles of a dead node on one added later)."""
        if self.pg is None:
            return None
        import ray

        table = ray.util.placement_group_table(ray.util.get_placement_group(self.pg))
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        placed = {int(i): node for i, node in (table.get("bundles_to_node_id") or {}).items()}
        used = set(self.bundles.values())
        free = [i for i, node in sorted(placed.items()) if i not in used and node in alive]
        return free[0] if free else None

    def heal(self, step: int, version: int) -> bool:
        """After a generation lost a worker: drop the ranks Ray reports dead (`drop_lost`: not a ping, which a
        survivor still generating its share would not answer in time); True when some are left to take the step's
        prompts again (False: nothing was dropped, or nothing is left; the flow's recovery takes over)."""
        return self.drop_lost(step, version)

    def _dead(self) -> list[tuple[int, str]]:
        """Ranks Ray reports dead, without calling them (a live rank may still be busy in a broken collective):
        their node is not alive (`node_lost`), or their actor is DEAD in Ray's actor table (`died`)."""
        import ray
        from ray._private.state import state

        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        out = []
        for i, handle in enumerate(self.group.handles):
            info = state.actor_table(handle._actor_id.hex()) or {}
            node = info.get("Address", {}).get("NodeID") or self.where.get(names(self.group)[i], "")
            if node and node not in alive:
                out.append((i, "node_lost"))
            elif info.get("State") == "DEAD":
                out.append((i, "died"))
        return out

    def drop_lost(self, step: int, version: int) -> bool:
        """After a failed generation or weight sync: wait (up to `LOST_WAIT_S`) for Ray to report the ranks it lost
        and remove them; True when some were removed and some are left (the call is then made again on those).
        False: none is reported dead (the failure was something else) or none is left; the caller re-raises."""
        if not elastic(self.cfg):
            return False
        deadline = time.monotonic() + LOST_WAIT_S
        while not (gone := self._dead()) and time.monotonic() < deadline:
            time.sleep(1.0)
        if not gone or len(gone) == len(self.group.handles):
            return False
        for index, reason in reversed(gone):
            self._remove(index, step, version, reason)
        return True

    def rescale(self, step: int, version: int) -> None:
        """Bring the group to the asked-for size (module docstring); the trainer's weights must be `version`."""
        if not elastic(self.cfg):
            return
        self.wanted = requested(self.run.path) or self.wanted
        self._nodes()
        gone = self._gone()
        if gone and len(gone) == len(self.group.handles):  # the group stays whole for the flow's rebuild
            raise WorkerLost(f"fleet: every rollout worker is gone at step {step}")
        for index, reason in reversed(gone):
            self._remove(index, step, version, reason)
        while len(self.group.handles) > self.wanted:
            self._remove(len(self.group.handles) - 1, step, version, "scale")
        while len(self.group.handles) < self.wanted and self._join(step, version):
            pass

    def _join(self, step: int, version: int) -> bool:
        """Start one rollout worker where it fits, give it the current weights; False when none fits now."""
        group, bundle = self.group, self._free_bundle()
        if bundle is None and not _fits(group):
            return False
        worker_id = joiner_id()
        timeout = float(self.cfg.cluster.rendezvous_timeout_seconds)
        try:
            handle = add_rank(group, worker_id, timeout, None if bundle is None else (str(self.pg), bundle))
        except Exception as exc:  # noqa: BLE001 - it did not start (resources taken meanwhile): try next step
            stage_logger().warning(f"fleet: a rollout worker could not join at step {step}: {exc}")
            return False
        name = names(group)[-1]
        if bundle is not None:
            self.bundles[name] = bundle
        try:
            self._sync(handle, version)
            self._nodes()
        except Exception:
            remove_rank(group, len(group.handles) - 1)  # never a rank without the current weights
            self.bundles.pop(name, None)
            raise
        self._event("worker_join", name, step, version, "scale")
        return True

    def _sync(self, handle: Any, version: int) -> None:
        push_weights(self.cfg, self.run, handle, version)

    def counts(self) -> dict[str, float]:
        """The step's fleet metrics: its size now and the joins and leaves since the last call."""
        out = {
            "fleet/rollout_workers": float(len(self.group.handles)),
            "fleet/joined": float(self.joined),
            "fleet/left": float(self.left),
        }
        self.joined = self.left = 0
        return out


def joiner_id() -> str:
    """A rollout worker id never used before in this run's driver (`elastic.add_rank`'s `worker_id`)."""
    return f"{os.getpid()}-{next(_IDS)}"


def push_weights(cfg: RunConfig, run: RunHandle, handle: Any, version: int) -> None:
    """The trainer's weights (policy `version`) pushed to one new rollout rank alone (the run's transport, a
    `SyncRound` of that rank), and its version stamped: a joiner's, or a restarted rank's, before its first prompt."""
    import ray

    workers = get_workers(run)
    actor, transport = workers.actor, workers.weight_sync
    assert transport is not None, "build_workers chooses the transport"
    timeout = cfg.prefect.policy("sync_weights").timeout_seconds or 600.0
    source = actor.collect_ranks()[0]
    transport.push(SyncRound(actor.handles, source, [handle], BUCKET_BYTES, cfg.rollout.dtype, timeout))
    ray.get(handle.__ray_call__.remote(stamp_version, version), timeout=timeout)


def _node_id(engine: Any) -> str:
    """Runs inside a rank: the Ray node id it lives on."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def _fits(group: ActorGroup) -> bool:
    """Whether one more rank of the group fits on some live node now (its CPUs, GPUs and custom resources free)."""
    import ray

    spec = group.spec
    need = {"CPU": spec.num_cpus, "GPU": spec.num_gpus, **spec.resources}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        free = _free_on(node["NodeID"])
        if all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v):
            return True
    return False


def _free_on(node_id: str) -> dict[str, float]:
    """The resources free on one node now (Ray's per-node view)."""
    from ray._private.state import state

    available = state.available_resources_per_node()
    return dict(available.get(node_id, {}))
