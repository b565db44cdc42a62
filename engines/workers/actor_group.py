"""Ray actor groups: plain engine classes become named Ray actors with resources from config.

Engines know nothing of Ray. A group places `num_workers` actors (ranks) of one engine class, each with a
rank in a (dp, pp, tp) mesh (tp fastest), calls methods *by attribute* through a dispatch proxy:

    group.all().load(path)                 # ONE_TO_ALL: same arguments to every rank
    group.one(0).save(path)                # rank 0 only
    group.dp().logprobs(batch)             # DP_COMPUTE: split batch by dp rank, collect from tp 0 / last pp
    group.pp_as_dp().logprobs(batch)       # PP_AS_DP: pp ranks act as more dp ranks (hybrid resharding)

Named actors let a retried Prefect task find them again (`get_if_exists`); `alive()` detects a dead
actor and `rebuild()` replaces the group. `in_process=True` runs the same engines without Ray (unit tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlstages.engines.imports import import_object
from rlstages.engines.runtime.rendezvous import (
    KEY_ENV,
    bundle_nodes,
    forget_master,
    local_ranks,
    node_ip,
    publish_master,
    wait_master,
)
from rlstages.engines.runtime.worker_env import worker_env
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.types import chunk_for_ranks, concat
from rlstages.engines.utils import free_port
from rlstages.engines.workers.driver_node import beside_driver


@dataclass(frozen=True)
class Placement:
    """Where a group's ranks go: a named placement group and its bundle per rank (None = anywhere)."""

    group_name: str | None = None
    bundle_indices: tuple[int, ...] = ()


@dataclass(frozen=True)
class GroupSpec:
    """Everything needed to (re)build a group: engine class path, constructor kwargs, resources, mesh."""

    name: str
    engine: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    num_workers: int = 1
    tp: int = 1
    pp: int = 1
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    threads: int = 1
    omp_passive: bool = True
    heap: str = "jemalloc"  # the allocator (`heap_env`): Ray's jemalloc, or glibc's heap "keep" / "bounded"
    env: dict[str, str] = field(default_factory=dict)
    extra_options: dict[str, Any] = field(default_factory=dict)
    placement: Placement = Placement()
    rendezvous_timeout: float = 300.0
    beside_driver: bool = False  # outside a placement group: on the driver's node (`driver_node`)

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks / (tp x pp)."""
        return self.num_workers // (self.tp * self.pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) coordinates of a rank in megatron-core's default order `tp-cp-ep-dp-pp`: tp varies
        fastest, then dp, pp slowest (the stages of one data-parallel replica are TP x DP ranks apart)."""
        return (rank // self.tp) % self.dp, rank // (self.tp * self.dp), rank % self.tp


class ActorGroup:
    """A set of ranks of one engine class, as named Ray actors or in-process objects."""

    def __init__(self, spec: GroupSpec, namespace: str = "rlstages", in_process: bool = False) -> None:
        if spec.num_workers % (spec.tp * spec.pp):
            raise ValueError(f"group {spec.name}: {spec.num_workers} workers is not a multiple of tp x pp")
        self.spec, self.namespace, self.in_process = spec, namespace, in_process
        self.handles: list[Any] = []
        self._build()

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def _actor_name(self, rank: int) -> str:
        return f"{self.spec.name}:{rank}"

    def _build(self) -> None:
        cls = import_object(self.spec.engine)
        if self.in_process:
            import torch

            torch.set_num_threads(self.spec.threads)
            self.handles = [cls(**self.spec.kwargs) for _ in range(self.spec.num_workers)]
            return
        import ray

        remote_cls: Any = ray.remote(_with_rendezvous(cls))
        key = self._rendezvous_key()
        try:  # a living rank 0 (a retried task finds it by name) keeps its published address
            ray.get_actor(self._actor_name(0), namespace=self.namespace)
        except ValueError:
            forget_master(key)
        self._locals = self._local_ranks()
        first = remote_cls.options(**self._options(0)).remote(**self.spec.kwargs)
        if self.spec.num_workers > 1:
            self._master = wait_master(key, first, self.spec.name, self.spec.rendezvous_timeout)
        self.handles = [first] + [
            remote_cls.options(**self._options(rank)).remote(**self.spec.kwargs)
            for rank in range(1, self.spec.num_workers)
        ]

    def _rendezvous_key(self) -> str:
        return f"{self.namespace}/{self.spec.name}"

    def _local_ranks(self) -> list[tuple[int, int]]:
        """(LOCAL_RANK, LOCAL_WORLD_SIZE) of every rank: per node when a placement group fixes the nodes."""
        p = self.spec.placement
        if p.group_name is None or not p.bundle_indices:
            return local_ranks([None] * self.spec.num_workers)
        return local_ranks(bundle_nodes(p.group_name, p.bundle_indices))

    def _options(self, rank: int) -> dict[str, Any]:
        spec = self.spec
        env = worker_env(spec.threads, {**self._dist_env(rank), **spec.env}, spec.omp_passive, spec.heap)
        options: dict[str, Any] = {
            "name": self._actor_name(rank),
            "namespace": self.namespace,
            "get_if_exists": True,
            "num_cpus": spec.num_cpus,
            "num_gpus": spec.num_gpus,
            "resources": dict(spec.resources) or None,
            "max_concurrency": 1,
        }
        extra = dict(spec.extra_options)
        runtime_env = dict(extra.pop("runtime_env", {}) or {})
        runtime_env["env_vars"] = {**env, **runtime_env.get("env_vars", {})}
        options["runtime_env"] = runtime_env
        options.update(extra)
        if spec.placement.group_name is not None:
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            pg = ray.util.get_placement_group(spec.placement.group_name)
            index = spec.placement.bundle_indices[rank] if spec.placement.bundle_indices else -1
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index
            )
        elif spec.beside_driver:
            options["scheduling_strategy"] = beside_driver()
        return {k: v for k, v in options.items() if v is not None}

    def _dist_env(self, rank: int) -> dict[str, str]:
        """torch.distributed wiring of a rank: RANK, WORLD_SIZE, LOCAL_RANK/LOCAL_WORLD_SIZE (per node), and
        MASTER_ADDR/PORT: rank 0 picks them on its own node (`rendezvous.publish_master`), the others get them."""
        local = getattr(self, "_locals", None) or local_ranks([None] * self.spec.num_workers)
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.spec.num_workers),
            "LOCAL_RANK": str(local[rank][0]),
            "LOCAL_WORLD_SIZE": str(local[rank][1]),
            KEY_ENV: self._rendezvous_key(),
        }
        if rank == 0:
            return env
        if not hasattr(self, "_master"):
            self._master = (node_ip(), free_port())
        env["MASTER_ADDR"], env["MASTER_PORT"] = self._master[0], str(self._master[1])
        return env

    def alive(self, timeout: float = 30.0) -> bool:
        """True when every rank answers; False when any actor died."""
        if self.in_process:
            return True
        import ray

        try:
            ray.get([h.__ray_ready__.remote() for h in self.handles], timeout=timeout)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ActorDiedError):
            return False

    def kill(self) -> None:
        """Kill every rank (named actors are freed so a rebuild can reuse the names)."""
        if self.in_process:
            self.handles = []
            return
        import ray

        for handle in self.handles:
            try:
                ray.kill(handle, no_restart=True)
            except ValueError:
                pass
        self.handles = []
        if hasattr(self, "_master"):
            del self._master  # a fresh rendezvous for the next process group
        try:
            forget_master(self._rendezvous_key())
        except Exception:  # noqa: BLE001 - the GCS is gone with the cluster: nothing to forget
            pass

    def wait_released(self, timeout: float = 60.0) -> None:
        """Block until the GCS has released every rank's name (killed actors), so a rebuild gets new actors."""
        if self.in_process:
            return
        import time

        import ray

        deadline = time.monotonic() + timeout  # the GCS forgets dead names asynchronously (slower under load)
        for rank in range(self.spec.num_workers):
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(self._actor_name(rank), namespace=self.namespace)
                except ValueError:
                    break
                time.sleep(0.1)
            else:
                raise TimeoutError(f"group {self.spec.name}: rank {rank}'s dead actor name was not released")

    def rebuild(self) -> None:
        """Replace every rank with a fresh actor (after a death); state must be reloaded by the caller."""
        self.kill()
        self.wait_released()
        self._build()

    def nodes(self, timeout: float = 60.0) -> list[str]:
        """The node id each rank runs on (placement checks, tests)."""
        if self.in_process:
            return ["local"] * len(self.handles)
        import ray

        def where(engine: Any) -> str:  # runs inside the actor
            import ray as r

            return str(r.get_runtime_context().get_node_id())

        return list(ray.get([h.__ray_call__.remote(where) for h in self.handles], timeout=timeout))

    def each(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """`fn(engine, *args)` inside every rank (Ray's `__ray_call__`; a plain call in-process), results by rank:
        for worker-side helpers that are no method of the engine (profilers)."""
        if self.in_process:
            return [fn(h, *args) for h in self.handles]
        import ray

        return list(ray.get([h.__ray_call__.remote(fn, *args) for h in self.handles], timeout=timeout))

    # ---- dispatch -------------------------------------------------------------------------------------------
    def all(self, timeout: float | None = None) -> _Dispatch:
        """ONE_TO_ALL: call the method on every rank with the same arguments; returns a list."""
        return _Dispatch(self, "all", timeout)

    def one(self, rank: int = 0, timeout: float | None = None) -> _Dispatch:
        """Call the method on one rank; returns its result."""
        return _Dispatch(self, "one", timeout, rank)

    def dp(self, timeout: float | None = None) -> _Dispatch:
        """DP_COMPUTE: split the first argument (a batch) by dp rank; gather from tp rank 0 of the last pp stage."""
        return _Dispatch(self, "dp", timeout)

    def pp_as_dp(self, timeout: float | None = None) -> _Dispatch:
        """PP_AS_DP: split across dp x pp ranks (pipeline stages act as extra data ranks); gather from tp 0."""
        return _Dispatch(self, "pp_as_dp", timeout)

    def collect_ranks(self, pp_as_dp: bool = False) -> list[int]:
        """Ranks whose outputs are gathered: tp rank 0 and (unless pp-as-dp) the last pipeline stage."""
        last = self.spec.pp - 1
        return [
            r
            for r in range(self.spec.num_workers)
            if self.spec.coords(r)[2] == 0 and (pp_as_dp or self.spec.coords(r)[1] == last)
        ]

    def _chunk_of(self, rank: int, pp_as_dp: bool) -> int:
        dp, pp, _ = self.spec.coords(rank)
        return dp * self.spec.pp + pp if pp_as_dp else dp

    def submit(self, method: str, ranks: Sequence[int], args_for: Callable[[int], tuple[tuple, dict]]) -> list[Any]:
        """Start `method` on `ranks`; returns Ray ObjectRefs (or results in-process)."""
        out = []
        for rank in ranks:
            args, kwargs = args_for(rank)
            target = getattr(self.handles[rank], method)
            out.append(target(*args, **kwargs) if self.in_process else target.remote(*args, **kwargs))
        return out

    def call(
        self,
        mode: str,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        rank: int = 0,
    ) -> Any:
        """Run `method` by `mode`: "all" (every rank, a list), "one" (`rank`), "dp" / "pp_as_dp" (the first
        argument split over the data-parallel ranks, the collecting ranks' results gathered)."""
        kwargs = kwargs or {}
        every = range(self.spec.num_workers)
        if mode == "all":
            return self.wait(self.submit(method, every, lambda r: (args, kwargs)), timeout)
        if mode == "one":
            return self.wait(self.submit(method, [rank], lambda r: (args, kwargs)), timeout)[0]
        pp_as_dp = mode == "pp_as_dp"
        batch, rest = args[0], args[1:]
        parts = self.spec.dp * (self.spec.pp if pp_as_dp else 1)
        chunks = chunk_for_ranks(batch, parts) if isinstance(batch, TensorDict) else _split_list(batch, parts)
        refs = self.submit(method, every, lambda r: ((chunks[self._chunk_of(r, pp_as_dp)], *rest), kwargs))
        results = self.wait(refs, timeout)
        return _gather([results[r] for r in self.collect_ranks(pp_as_dp)])

    def wait(self, refs: list[Any], timeout: float | None) -> list[Any]:
        """Block for results; a blocking ray.get gets its own timeout (a Prefect thread cannot be interrupted)."""
        if self.in_process:
            return refs
        import ray

        return ray.get(refs, timeout=timeout)


class _Dispatch:
    """Attribute proxy: `group.dp().logprobs(batch)` dispatches `logprobs` by the chosen mode (`ActorGroup.call`)."""

    def __init__(self, group: ActorGroup, mode: str, timeout: float | None, rank: int = 0) -> None:
        self.group, self.mode, self.timeout, self.rank = group, mode, timeout, rank

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return self.group.call(self.mode, method, args, kwargs, self.timeout, self.rank)

        return call


def _with_rendezvous(cls: type[Any]) -> type:
    """`cls` whose constructor first publishes rank 0's rendezvous (a subclass defined here, so Ray ships it
    by value; the engine class stays a plain class)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        publish_master()
        cls.__init__(self, *args, **kwargs)

    ranked = type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": cls.__doc__})
    ranked.__qualname__ = f"_with_rendezvous.<locals>.{cls.__name__}"
    return ranked


def _split_list(items: Sequence[Any], parts: int) -> list[list[Any]]:
    bounds = [len(items) * r // parts for r in range(parts + 1)]
    return [list(items[bounds[r] : bounds[r + 1]]) for r in range(parts)]


def _gather(results: list[Any]) -> Any:
    import torch

    if len(results) == 1:
        return results[0]
    first = results[0]
    if isinstance(first, TensorDict):
        return concat(results)
    if isinstance(first, torch.Tensor):
        return torch.cat(results)
    if isinstance(first, list):
        return [x for r in results for x in r]
    return results
