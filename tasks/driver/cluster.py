"""Ray start-up and the driver's registry of live worker groups, built from the engine specs (`tasks.driver.specs`).

Tasks never receive actor handles: they look the groups up here by the run's key. The run's start builds them
(a new process, a retried flow run: named actors make a build inside the same Ray cluster find the living ones);
looking up a run that was not started is an error, never an implicit build.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from rlstages.configs.run import RunConfig
from rlstages.engines.models import PLUGINS_ENV, import_plugins
from rlstages.engines.sync.protocol import WeightSync
from rlstages.engines.sync.registry import build_weight_sync, choose_transport
from rlstages.engines.workers.actor_group import ActorGroup, GroupSpec
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.placement import place, release, report
from rlstages.tasks.driver.ray_auth import init_local_ray
from rlstages.tasks.driver.specs import hybrid_spec, reward_model_spec, reward_spec, rollout_spec, training_spec

log = logging.getLogger(__name__)


@dataclass
class Workers:
    """The live groups of one run."""

    rollout: ActorGroup
    actor: ActorGroup
    reward: ActorGroup
    reference: ActorGroup | None = None
    critic: ActorGroup | None = None
    reward_model: ActorGroup | None = None
    weight_sync: WeightSync | None = None  # trainer -> rollout transport, chosen once (`engines.sync.registry`)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hybrid(self) -> bool:
        """True when the actor group also hosts the rollout engines."""
        return self.rollout is self.actor

    def groups(self) -> dict[str, ActorGroup]:
        """Every distinct group by role (a hybrid group is listed once, as the actor)."""
        named = {
            "rollout": self.rollout,
            "actor": self.actor,
            "reward": self.reward,
            "reference": self.reference,
            "critic": self.critic,
            "reward_model": self.reward_model,
        }
        return {k: v for k, v in named.items() if v is not None}


_REGISTRY: dict[str, Workers] = {}


def ray_address(cfg: RunConfig) -> str | None:
    """The cluster the run joins (`cluster.address`, else RAY_ADDRESS); None: it starts a local Ray of its own."""
    return cfg.cluster.address or os.environ.get("RAY_ADDRESS")


def start_ray(cfg: RunConfig) -> None:
    """Connect to `cluster.address` / RAY_ADDRESS, or start a local Ray (no dashboard)."""
    if cfg.cluster.mode != "ray":
        return
    import ray

    if ray.is_initialized():
        return
    address = ray_address(cfg)
    level = cfg.cluster.worker_log_level
    kwargs: dict[str, Any] = {"namespace": cfg.cluster.namespace, "log_to_driver": level != "off"}
    if level != "off":  # the actors' Python logging at this level; their lines reach the driver's stderr
        kwargs["logging_config"] = ray.LoggingConfig(log_level=level)
    root = logging.getLogger()
    handlers, root_level = root.handlers[:], root.level
    with sigterm_handler_kept():
        if address:  # the cluster's own auth applies (a token file or RAY_AUTH_TOKEN enables it here)
            ray.init(address=address, **kwargs)
        else:  # ours: token auth on, 127.0.0.1 only
            init_local_ray(num_cpus=cfg.cluster.num_cpus, include_dashboard=False, **kwargs)
    root.handlers[:], root.level = handlers, root_level  # logging_config is for the actors: the driver keeps its own


def export_plugins(cfg: RunConfig) -> None:
    """The driver and every worker import the user's registrations (`model.plugins`): the variable is set before
    Ray starts, whose workers inherit it."""
    if cfg.model.plugins:
        os.environ[PLUGINS_ENV] = ",".join(cfg.model.plugins)
        import_plugins()


def start_local_ray_early(cfg: RunConfig) -> None:
    """Start the run's own local Ray now (~3 s), while Prefect's temporary server and the model's build start, so
    `build_workers` finds it up; where it fails here, the run's `start_workers` starts it again and reports why."""
    if cfg.cluster.mode != "ray" or ray_address(cfg):
        return  # a cluster's own errors belong to the run's start_workers stage
    try:
        export_plugins(cfg)
        start_ray(cfg)
    except Exception as exc:  # noqa: BLE001 - the stage tries again, inside the flow, where failures are recorded
        log.warning(f"Ray did not start early ({exc}); the run's start_workers stage starts it")
        import ray

        ray.shutdown()


@contextmanager
def sigterm_handler_kept() -> Iterator[None]:
    """Put back the SIGTERM handler a Python caller installed (the flow's stop at a safe point, `flows.interrupts`)
    after `ray.init`, which sets its own (`sys.exit`) in the main thread: without this a SIGTERM to a run on Ray
    crashed the flow instead of stopping it (MLflow not KILLED, Prefect's temporary server left running)."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(before) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, before)


def build_workers(cfg: RunConfig, run: RunHandle) -> Workers:
    """Create (or find, by name) every group of the run and remember them in the registry."""
    export_plugins(cfg)
    start_ray(cfg)
    in_process = cfg.cluster.mode == "in_process"
    ns = cfg.cluster.namespace

    def group(spec: GroupSpec | None) -> ActorGroup | None:
        return ActorGroup(spec, ns, in_process) if spec is not None else None

    specs = {"actor": training_spec(cfg, run, "actor"), "rollout": rollout_spec(cfg, run)}
    if cfg.cluster.hybrid_engine:
        specs["actor"] = hybrid_spec(specs["actor"], specs.pop("rollout"))
    if cfg.uses_reference and cfg.model.lora is None:  # under LoRA the actor's frozen base is the reference
        specs["reference"] = training_spec(cfg, run, "reference")
    if cfg.critic is not None:
        specs["critic"] = training_spec(cfg, run, "critic")
    timeout = cfg.cluster.rendezvous_timeout_seconds
    specs = place(cfg, run, {k: replace(v, rendezvous_timeout=timeout) for k, v in specs.items()})
    actor = ActorGroup(specs["actor"], ns, in_process)
    workers = Workers(
        rollout=actor if cfg.cluster.hybrid_engine else ActorGroup(specs["rollout"], ns, in_process),
        actor=actor,
        reward=ActorGroup(reward_spec(cfg, run), ns, in_process),
        reference=group(specs.get("reference")),
        critic=group(specs.get("critic")),
        reward_model=group(reward_model_spec(cfg, run)),
    )
    placement = "hybrid" if cfg.cluster.hybrid_engine else "split"
    transport = choose_transport(placement, cfg.cluster.mode, cfg.cluster.weight_sync)
    workers.weight_sync = build_weight_sync(transport)
    _REGISTRY[run.key] = workers
    if cfg.cluster.use_placement_group and not in_process:  # what runs where, for operators and the cluster tests
        report(workers.groups(), run.path / "placement.json", timeout)  # it waits for the constructors too
    return workers


class NoWorkers(RuntimeError):
    """A stage asked for the workers of a run that this process has not started (`build_workers`)."""


def get_workers(run: RunHandle) -> Workers:
    """The run's live groups, as `build_workers` (the run's start) or `rebuild_workers` left them; never builds any."""
    workers = _REGISTRY.get(run.key)
    if workers is None:
        raise NoWorkers(f"run {run.name} ({run.path}): no workers in this process; the run's start builds them")
    return workers


def rebuild_workers(cfg: RunConfig, run: RunHandle) -> Workers:
    """After a worker death: kill every group, release the reservations and place the layout again on what
    the cluster has now (a node added since is used; too little left is `not enough GPUs: need X, have Y`)."""
    workers = _REGISTRY.pop(run.key, None)
    if workers is not None:
        for g in workers.groups().values():
            g.kill()
        for g in workers.groups().values():
            g.wait_released()
    release(run)
    return build_workers(cfg, run)


def ray_gone(timeout: float = 2.0) -> bool:
    """Whether the Ray cluster this process joined no longer answers (its GCS, within `timeout` seconds): a SIGTERM
    to the run's whole process group (`timeout`, `kill -- -PGID`, a systemd unit's stop) ends the local Ray's
    processes with the driver, and every later Ray call waits a minute for them."""
    import ray

    if not ray.is_initialized():
        return False
    gcs: Any = ray._private.worker.global_worker.gcs_client  # type: ignore[attr-defined]  # set by ray.init
    try:
        gcs.internal_kv_exists(b"rlstages", namespace=None, timeout=timeout)
    except Exception:  # noqa: BLE001 - any RPC error: the GCS is gone
        return True
    return False


def forget_workers(run: RunHandle, kill: bool = True) -> None:
    """Drop the run's groups (killing the actors) at the end of a run; where the Ray cluster is gone with them
    (`ray_gone`), only forget them."""
    workers = _REGISTRY.pop(run.key, None)
    if workers is not None and kill:
        if ray_gone():
            log.warning("the Ray cluster no longer answers (stopped with the run?): its workers are gone with it")
            return
        for g in workers.groups().values():
            g.kill()
        release(run)
