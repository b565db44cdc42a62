"""ClusterConfig: the Ray cluster, how workers are placed on it, and how weights reach the rollout."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlstages.configs.base import StrictModel


class ClusterConfig(StrictModel):
    """The Ray cluster and how workers are placed on it."""

    mode: Literal["ray", "in_process"] = Field(
        default="ray", description="in_process runs the engines in the driver (debugging, unit tests)."
    )
    address: str | None = Field(default=None, description="None = start Ray locally (or RAY_ADDRESS).")
    num_cpus: int | None = None
    num_gpus: int = Field(default=0, ge=0, description="GPUs available to this run.")
    gpus_per_worker: float = Field(default=1.0, ge=0.0)
    colocate: bool = Field(default=True, description="Trainer, reference and rollout share placement bundles.")
    hybrid_engine: bool = Field(
        default=False,
        description="Actor trainer and rollout engine live in the same worker process; weight sync is an "
        "in-process copy (needs colocate and as many rollout as actor workers).",
    )
    nccl_cumem_enable: bool | None = Field(
        default=None,
        description="NCCL_CUMEM_ENABLE of every GPU worker, trainers and inference engines alike (NCCL's cuMem "
        "allocator on one side of a shared group and not the other breaks it; verl/slime set false, NeMo-RL true "
        "when not colocated). None = leave NCCL's and the engines' own default.",
    )
    cuda_device_max_connections: int | None = Field(
        default=None,
        ge=1,
        description="CUDA_DEVICE_MAX_CONNECTIONS of every GPU worker. None = the engines' own: 1 for Megatron-Core "
        "trainers (its communication overlap needs ordered kernels), CUDA's default elsewhere.",
    )
    threads_per_worker: int = Field(default=1, ge=1, description="torch threads per worker (no spinning).")
    omp_wait_policy: Literal["auto", "passive", "spin"] = Field(
        default="auto",
        description="Idle OpenMP threads of a worker: passive sleeps at once (safe when workers compute at the "
        "same time); spin busy-waits briefly first (~1.7x faster for a lone busy worker); auto = spin when "
        "one hybrid worker does all the torch work, else passive.",
    )
    heap: Literal["jemalloc", "keep", "bounded"] = Field(
        default="jemalloc",
        description="Allocator of the workers: jemalloc (the one Ray's wheel ships, preloaded: less "
        "fragmentation, freed memory goes back to the OS; glibc's keep where Ray lacks it), or glibc's "
        "heap of one arena that keeps every freed block (no page faults re-touching large tensors; the heap "
        "only grows) or bounded (blocks >= 64 MB are returned when freed, the free top is trimmed past 256 MB).",
    )
    namespace: str = "rlstages"
    worker_log_level: Literal["off", "ERROR", "WARNING", "INFO", "DEBUG"] = Field(
        default="WARNING",
        description="Python logging of the Ray actors at this level and above, and their stdout/stderr, shown in the "
        "driver's log; off = none.",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    placement_group: bool | None = Field(
        default=None,
        description="Reserve one bundle per rank up front (colocated roles share bundle i). None = on whenever "
        "GPUs are requested (cluster.num_gpus > 0); false with GPUs is refused (colocated roles would each ask "
        "Ray for their own GPUs).",
    )
    cpus_per_bundle: float = Field(default=1.0, gt=0.0, description="CPUs reserved in each placement bundle.")
    placement_timeout_seconds: float = Field(default=60.0, gt=0.0)
    rollout_resources: dict[str, float] = Field(
        default_factory=dict, description="Extra custom Ray resources each rollout worker needs (node pinning)."
    )
    trainer_resources: dict[str, float] = Field(default_factory=dict)
    weight_sync: Literal["auto", "collective", "object_store"] = Field(
        default="auto",
        description="Split placement's trainer -> rollout transport: collective = a torch.distributed broadcast "
        "group (gloo on CPU, NCCL on GPUs) from the trainer's source rank to every rollout worker (vLLM's and "
        "SGLang's own worker processes join it), buckets streamed, through shared memory when all are on one "
        "CPU node; object_store = buckets through Ray's object store. auto = collective. The hybrid engine "
        "copies in-process either way.",
    )
    rendezvous_timeout_seconds: float = Field(
        default=300.0,
        gt=0.0,
        description="How long a multi-rank group waits for its rank 0 to be scheduled and publish its "
        "torch.distributed address (a clear error instead of a hang when the cluster lacks the resources).",
    )

    @property
    def use_placement_group(self) -> bool:
        """Placement groups reserve the layout: on when asked, and always when GPUs are requested."""
        return self.placement_group if self.placement_group is not None else self.num_gpus > 0
