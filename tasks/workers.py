"""From a RunConfig to worker groups: engine specs, Ray start-up, and the driver's registry of live groups.

Tasks never receive actor handles: they look the groups up here by the run's key. If the registry is
empty (a new process, a retried flow run), the groups are rebuilt from the config; named actors make a
rebuild inside the same Ray cluster find the living ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlstages.configs.rollout import HFRolloutConfig, SGLangRolloutConfig, VLLMRolloutConfig
from rlstages.configs.run import RunConfig
from rlstages.configs.training import MegatronTrainingConfig, TorchTrainingConfig
from rlstages.engines.algorithms import PolicyLossParams
from rlstages.engines.models import PLUGINS_ENV, import_plugins
from rlstages.engines.registry import REWARD_ENGINES, ROLLOUT_ENGINES, TRAINING_ENGINES, engine_path, missing_package
from rlstages.engines.runtime.actor_group import ActorGroup, GroupSpec
from rlstages.engines.training.torch_trainer import BatchingParams, OptimParams
from rlstages.tasks.context import RunHandle
from rlstages.tasks.placement import place, release

_COMMON_TRAINING = set(TorchTrainingConfig.model_fields)


@dataclass
class Workers:
    """The live groups of one run."""

    rollout: ActorGroup
    actor: ActorGroup
    reward: ActorGroup
    reference: ActorGroup | None = None
    critic: ActorGroup | None = None
    reward_model: ActorGroup | None = None
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


def start_ray(cfg: RunConfig) -> None:
    """Connect to `cluster.address` / RAY_ADDRESS, or start a local Ray (no dashboard)."""
    if cfg.cluster.mode != "ray":
        return
    import ray

    if ray.is_initialized():
        return
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    kwargs: dict[str, Any] = {"namespace": cfg.cluster.namespace, "log_to_driver": False}
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=cfg.cluster.num_cpus, include_dashboard=False, **kwargs)


def _model_path(cfg: RunConfig) -> str:
    return str(cfg.model.path.resolve())


def converted_dir(cfg: RunConfig) -> Path | None:
    """Where the actor's Megatron-Core checkpoint is converted to (None when the actor is not Megatron)."""
    a = cfg.actor
    if not isinstance(a, MegatronTrainingConfig):
        return None
    vpp = f"-vpp{a.virtual_pipeline_model_parallel_size}" if a.virtual_pipeline_model_parallel_size else ""
    name = f"{cfg.model.path.name}-tp{a.tensor_model_parallel_size}-pp{a.pipeline_model_parallel_size}{vpp}"
    return (Path(".cache") / "mcore" / name).resolve()


def missing_backend_package(cfg: RunConfig) -> str | None:
    """A one-line error for the first chosen backend whose package this machine lacks. Only when Ray starts
    here (a remote cluster's workers have their own packages); vLLM in its own venv (`rollout.python` or
    .venv-vllm) is the venv's business."""
    from rlstages.engines.rollout.vllm_rollout import default_vllm_python

    if cfg.cluster.mode == "ray" and (cfg.cluster.address or os.environ.get("RAY_ADDRESS")):
        return None
    chosen = [("actor.backend", cfg.actor.backend)]
    if cfg.critic is not None:
        chosen.append(("critic.backend", cfg.critic.backend))
    r = cfg.rollout
    if not (isinstance(r, VLLMRolloutConfig) and (r.python or default_vllm_python())):
        chosen.append(("rollout.backend", r.backend))
    return next((msg for field, backend in chosen if (msg := missing_package(field, backend))), None)


def rollout_spec(cfg: RunConfig, run: RunHandle) -> GroupSpec:
    """Rollout engine spec: backend-specific constructor arguments."""
    r = cfg.rollout
    kwargs: dict[str, Any] = {
        "model_path": _model_path(cfg),
        "dtype": r.dtype,
        "apply_chat_template": cfg.data.apply_chat_template,
        "system_prompt": cfg.data.system_prompt,
    }
    extra: dict[str, Any] = {}
    if isinstance(r, HFRolloutConfig):
        kwargs.update(batch_size=r.batch_size, model_type=cfg.model.model_type)
    elif isinstance(r, VLLMRolloutConfig):
        from rlstages.engines.rollout.vllm_rollout import vllm_actor_options

        kwargs.update(
            tensor_parallel_size=r.tensor_parallel_size,
            gpu_memory_utilization=r.gpu_memory_utilization,
            enable_sleep_mode=r.enable_sleep_mode,
            sleep_level=r.sleep_level,
            enforce_eager=r.enforce_eager,
            max_model_len=r.max_model_len,
            seed=cfg.trainer.seed,
            cpu_kvcache_space_gb=r.cpu_kvcache_space_gb,
        )
        extra = vllm_actor_options(str(r.python) if r.python else None)
    elif isinstance(r, SGLangRolloutConfig):
        kwargs.update(
            tp_size=r.tp_size,
            mem_fraction_static=r.mem_fraction_static,
            enable_memory_saver=r.enable_memory_saver,
            seed=cfg.trainer.seed,
        )
    return GroupSpec(
        name=f"{run.name}-{run.key}-rollout",
        engine=engine_path(ROLLOUT_ENGINES, r.backend),
        kwargs=kwargs,
        num_workers=r.num_workers,
        num_gpus=cfg.cluster.gpus_per_worker if cfg.cluster.num_gpus else 0.0,
        resources=dict(cfg.cluster.rollout_resources),
        threads=cfg.cluster.threads_per_worker,
        omp_passive=cfg.omp_passive,
        heap=cfg.cluster.heap,
        extra_options=extra,
    )


def loss_params(cfg: RunConfig) -> PolicyLossParams:
    """The actor's loss knobs from the algorithm section."""
    a = cfg.algorithm
    return PolicyLossParams(
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode,
        loss_scale_factor=a.loss_scale_factor or cfg.rollout.max_new_tokens,
        entropy_coeff=a.entropy_coeff,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
    )


def training_spec(cfg: RunConfig, run: RunHandle, role: str) -> GroupSpec:
    """Actor / critic / reference spec: the common constructor arguments plus the backend's own options."""
    train = cfg.critic if role == "critic" else cfg.actor
    assert train is not None
    backend = cfg.reference.backend if role == "reference" else train.backend
    mini = cfg.mini_batch_prompts
    o = train.optim
    optim = OptimParams(
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        weight_decay=o.weight_decay,
        grad_clip=o.grad_clip,
        warmup_steps=o.warmup_steps,
        schedule=o.schedule,
        min_lr_ratio=o.min_lr_ratio,
        total_steps=(o.total_steps or cfg.trainer.total_steps) * train.ppo_epochs * (cfg.data.prompts_per_step // mini),
    )
    batching = BatchingParams(
        ppo_epochs=train.ppo_epochs,
        num_mini_batches=cfg.data.prompts_per_step // mini,
        micro_batch_size=cfg.reference.micro_batch_size if role == "reference" else train.micro_batch_size,
        dynamic_batching=train.dynamic_batching,
        max_tokens_per_micro_batch=train.max_tokens_per_micro_batch,
        bf16_autocast=train.bf16_autocast,
        gradient_checkpointing=train.gradient_checkpointing,
    )
    kwargs: dict[str, Any] = {
        "model_path": _model_path(cfg),
        "role": role,
        "optim": optim,
        "batching": batching,
        "loss": loss_params(cfg),
        "cliprange_value": cfg.algorithm.cliprange_value,
        "temperature": cfg.rollout.temperature or 1.0,
        "dtype": cfg.model.dtype,
        "model_type": cfg.model.model_type,
        "seed": cfg.trainer.seed,
    }
    if role != "reference" and backend == train.backend:
        kwargs.update({k: v for k, v in train.model_dump().items() if k not in _COMMON_TRAINING})
    if backend == "megatron" and role == "actor":
        kwargs["converted_path"] = str(converted_dir(cfg))
    tp = getattr(train, "tensor_model_parallel_size", 1) if role != "reference" else 1
    pp = getattr(train, "pipeline_model_parallel_size", 1) if role != "reference" else 1
    workers = cfg.reference.num_workers if role == "reference" else train.num_workers
    return GroupSpec(
        name=f"{run.name}-{run.key}-{role}",
        engine=engine_path(TRAINING_ENGINES, backend),
        kwargs=kwargs,
        num_workers=workers,
        tp=tp,
        pp=pp,
        num_gpus=cfg.cluster.gpus_per_worker if cfg.cluster.num_gpus else 0.0,
        resources=dict(cfg.cluster.trainer_resources),
        threads=cfg.cluster.threads_per_worker,
        omp_passive=cfg.omp_passive,
        heap=cfg.cluster.heap,
    )


def reward_spec(cfg: RunConfig, run: RunHandle) -> GroupSpec:
    """The reward-function scorer (a process pool inside one actor)."""
    fns = [(f.name, f.weight, dict(f.kwargs)) for f in cfg.reward.functions]
    kwargs = {
        "functions": fns,
        "timeout_seconds": cfg.reward.timeout_seconds,
        "fallback_score": cfg.reward.fallback_score,
        "num_processes": cfg.reward.num_processes,
    }
    return GroupSpec(
        name=f"{run.name}-{run.key}-reward", engine=engine_path(REWARD_ENGINES, "functions"), kwargs=kwargs
    )


def reward_model_spec(cfg: RunConfig, run: RunHandle) -> GroupSpec | None:
    """The reward model actor, when configured."""
    rm = cfg.reward.reward_model
    if rm is None:
        return None
    kwargs = {"path": str(rm.path), "micro_batch_size": rm.micro_batch_size}
    return GroupSpec(
        name=f"{run.name}-{run.key}-rm",
        engine=engine_path(REWARD_ENGINES, "model"),
        kwargs=kwargs,
        threads=cfg.cluster.threads_per_worker,
        omp_passive=cfg.omp_passive,
        heap=cfg.cluster.heap,
    )


def hybrid_spec(trainer: GroupSpec, rollout: GroupSpec) -> GroupSpec:
    """One group whose ranks hold both the trainer and a rollout engine (`runtime.hybrid.HybridEngine`)."""
    kwargs = {
        "trainer": trainer.engine,
        "trainer_kwargs": trainer.kwargs,
        "rollout": rollout.engine,
        "rollout_kwargs": rollout.kwargs,
    }
    options = {**rollout.extra_options, **trainer.extra_options}
    return replace(
        trainer,
        name=trainer.name.replace("-actor", "-hybrid"),
        engine="rlstages.engines.runtime.hybrid:HybridEngine",
        kwargs=kwargs,
        resources={**rollout.resources, **trainer.resources},
        extra_options=options,
    )


def build_workers(cfg: RunConfig, run: RunHandle) -> Workers:
    """Create (or find, by name) every group of the run and remember them in the registry."""
    if cfg.model.plugins:  # the driver and every worker import the user's registrations
        os.environ[PLUGINS_ENV] = ",".join(cfg.model.plugins)
        import_plugins()
    start_ray(cfg)
    in_process = cfg.cluster.mode == "in_process"
    ns = cfg.cluster.namespace

    def group(spec: GroupSpec | None) -> ActorGroup | None:
        return ActorGroup(spec, ns, in_process) if spec is not None else None

    specs = {"actor": training_spec(cfg, run, "actor"), "rollout": rollout_spec(cfg, run)}
    if cfg.cluster.hybrid_engine:
        specs["actor"] = hybrid_spec(specs["actor"], specs.pop("rollout"))
    if cfg.uses_reference:
        specs["reference"] = training_spec(cfg, run, "reference")
    if cfg.critic is not None:
        specs["critic"] = training_spec(cfg, run, "critic")
    specs = place(cfg, run, specs)
    actor = ActorGroup(specs["actor"], ns, in_process)
    workers = Workers(
        rollout=actor if cfg.cluster.hybrid_engine else ActorGroup(specs["rollout"], ns, in_process),
        actor=actor,
        reward=ActorGroup(reward_spec(cfg, run), ns, in_process),
        reference=group(specs.get("reference")),
        critic=group(specs.get("critic")),
        reward_model=group(reward_model_spec(cfg, run)),
    )
    _REGISTRY[run.key] = workers
    return workers


def get_workers(cfg: RunConfig, run: RunHandle) -> Workers:
    """The run's live groups (rebuilt from the config if this process has none)."""
    return _REGISTRY.get(run.key) or build_workers(cfg, run)


def forget_workers(run: RunHandle, kill: bool = True) -> None:
    """Drop the run's groups (killing the actors) at the end of a run."""
    workers = _REGISTRY.pop(run.key, None)
    if workers is not None and kill:
        for g in workers.groups().values():
            g.kill()
        release(run)
