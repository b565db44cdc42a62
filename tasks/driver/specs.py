"""From a RunConfig to engine specs: what each group runs (engine class, constructor arguments, resources).

Backend-specific constructor arguments come from the backend's registry entry (`engines.registry`), not from
an if-chain here: a rollout backend names the config fields it takes, a training backend reads its own
options from the `TrainerSettings` built once by `trainer_settings`.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from rlstages.configs.run import RunConfig
from rlstages.engines.algorithms import PolicyLossParams
from rlstages.engines.imports import import_object
from rlstages.engines.registry import (
    REWARD_ENGINES,
    TRAINING_ENGINE,
    TrainingOptions,
    engine_path,
    missing_package,
    reference_options,
    rollout_backend,
    training_backend,
)
from rlstages.engines.runtime.device import gpu_env
from rlstages.engines.training.settings import Role, TrainerSettings
from rlstages.engines.workers.actor_group import GroupSpec
from rlstages.tasks.driver.context import RunHandle


def worker_gpu_env(cfg: RunConfig) -> dict[str, str]:
    """The GPU env every trainer and rollout worker gets alike (`cluster.nccl_cumem_enable`,
    `cluster.cuda_device_max_connections`); nothing without GPUs."""
    c = cfg.cluster
    return gpu_env(c.nccl_cumem_enable, c.cuda_device_max_connections) if c.num_gpus else {}


def model_dir(cfg: RunConfig) -> str:
    """The policy's local directory: `model.path`, or a hub id's snapshot in the HF cache."""
    from rlstages.engines.models import resolve_model_path

    return str(resolve_model_path(str(cfg.model.path), cfg.model.revision))


def converted_dir(cfg: RunConfig) -> Path | None:
    """Where the actor's checkpoint is converted to before it starts (None when its backend reads HF weights)."""
    layout = converted_layout(cfg)
    return None if layout is None else (Path(".cache") / "mcore" / layout[0]).resolve()


def converted_layout(cfg: RunConfig) -> tuple[str, dict[str, Any]] | None:
    """(the converted directory's name, the converter's layout arguments) of the actor's backend
    (its registry entry's `hf_convert`), or None when it reads HF weights as they are."""
    convert = training_backend(cfg.actor.backend).hf_convert
    if convert is None:
        return None
    return import_object(convert, "actor.backend", expected="function")(cfg.actor, cfg.model.path.name)


def missing_backend_package(cfg: RunConfig) -> str | None:
    """A one-line error for the first chosen backend whose package this machine lacks. Only when Ray starts
    here (a remote cluster's workers have their own packages); vLLM in its own venv (`rollout.python` or
    .venv-vllm) is the venv's business."""
    if cfg.cluster.mode == "ray" and (cfg.cluster.address or os.environ.get("RAY_ADDRESS")):
        return None
    chosen: list[tuple[str, str]] = [("actor.backend", cfg.actor.backend)]
    if cfg.critic is not None:
        chosen.append(("critic.backend", cfg.critic.backend))
    r = cfg.rollout
    if own_python(cfg) is None:  # a rollout in a venv of its own has its packages there
        chosen.append(("rollout.backend", r.backend))
    return next((msg for field, backend in chosen if (msg := missing_package(field, backend))), None)


def own_python(cfg: RunConfig) -> str | None:
    """The interpreter of the rollout backend's own venv (`rollout.python`, or one it finds), None when it runs in
    this one (its registry entry's `interpreter`)."""
    find = rollout_backend(cfg.rollout.backend).interpreter
    if find is None:
        return None
    python = getattr(cfg.rollout, "python", None)
    found = import_object(find, "rollout.backend", expected="function")(str(python) if python else None)
    return str(found) if found else None


def rollout_spec(cfg: RunConfig, run: RunHandle) -> GroupSpec:
    """Rollout engine spec: the common constructor arguments plus those the backend's registry entry names."""
    r = cfg.rollout
    entry = rollout_backend(r.backend)
    run_values = {
        "seed": cfg.trainer.seed,
        "model_type": cfg.model.model_type,
        "max_images_per_prompt": cfg.data.max_images_per_prompt,  # vLLM's limit_mm_per_prompt
    }
    kwargs: dict[str, Any] = {
        "model_path": model_dir(cfg),
        "dtype": r.dtype,
        "apply_chat_template": cfg.data.apply_chat_template,
        "system_prompt": cfg.data.system_prompt,
        **{name: _plain(getattr(r, name)) for name in entry.options},
        **{name: run_values[name] for name in entry.run_args},
    }
    if cfg.data.chat_template:
        kwargs["chat_template"] = cfg.data.chat_template
    if cfg.data.image_min_pixels or cfg.data.image_max_pixels:  # a vision-language model's image processor
        kwargs["image_pixels"] = (cfg.data.image_min_pixels, cfg.data.image_max_pixels)
    extra: dict[str, Any] = {}
    if entry.actor_options is not None:
        python = getattr(r, "python", None)
        extra = import_object(entry.actor_options, "rollout.backend", expected="function")(
            str(python) if python else None
        )
    return GroupSpec(
        name=f"{run.name}-{run.key}-rollout",
        engine=entry.engine,
        kwargs=kwargs,
        num_workers=r.num_workers,
        num_gpus=cfg.cluster.gpus_per_worker if cfg.cluster.num_gpus else 0.0,
        resources=dict(cfg.cluster.rollout_resources),
        env=worker_gpu_env(cfg),
        threads=cfg.cluster.threads_per_worker,
        omp_passive=cfg.omp_passive,
        heap=cfg.cluster.heap,
        extra_options=extra,
    )


def _plain(value: Any) -> Any:
    """A config section as plain data (a dict) for an engine's constructor, which may run in another venv."""
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def loss_params(cfg: RunConfig) -> PolicyLossParams:
    """The actor's loss knobs from the algorithm section."""
    a = cfg.algorithm
    return PolicyLossParams(
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode,
        loss_scale_factor=a.loss_scale_factor or cfg.rollout.response_budget,
        entropy_coeff=a.entropy_coeff,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
        name=a.policy_loss,
        gspo_clip_ratio_low=a.gspo.clip_ratio_low,
        gspo_clip_ratio_high=a.gspo.clip_ratio_high,
        cispo_clip_ratio_low=a.cispo.clip_ratio_low,
        cispo_clip_ratio_high=a.cispo.clip_ratio_high,
        clip_cov_ratio=a.clip_cov.ratio,
        clip_cov_lb=a.clip_cov.lb,
        clip_cov_ub=a.clip_cov.ub,
        kl_cov_ratio=a.kl_cov.ratio,
        kl_cov_coef=a.kl_cov.coef,
        dp_size=cfg.actor.grad_average_ranks,
    )


def trainer_settings(cfg: RunConfig, role: Role) -> TrainerSettings:
    """The settings of the actor, critic or reference engine. Actor and critic take their config section as
    is; the reference runs the actor's batching with its own backend (at that backend's default options),
    micro-batch size and worker count."""
    train: TrainingOptions
    if role == "reference":
        ref = cfg.reference
        train = reference_options(cfg.actor, ref.backend, ref.micro_batch_size, ref.num_workers)
    else:
        section = cfg.critic if role == "critic" else cfg.actor
        assert section is not None
        train = section
    converted = converted_dir(cfg) if role == "actor" else None
    return TrainerSettings(
        model_path=model_dir(cfg),
        role=role,
        train=train,
        loss=loss_params(cfg),
        num_mini_batches=cfg.data.prompts_per_step // cfg.mini_batch_prompts,
        train_steps=cfg.trainer.total_steps,
        cliprange_value=cfg.algorithm.cliprange_value,
        temperature=cfg.rollout.temperature or 1.0,
        dtype=cfg.model.dtype,
        model_type=cfg.model.model_type,
        seed=cfg.trainer.seed,
        converted_path=str(converted) if converted is not None else None,
        lora=cfg.model.lora.model_dump() if cfg.model.lora is not None and role == "actor" else None,
        shares_device=shares_device(cfg),
    )


def shares_device(cfg: RunConfig) -> bool:
    """Whether an engine in another process uses the trainers' GPUs, so a trainer hands its cached blocks back
    after each forward and update: colocated roles do, except a hybrid worker alone on its GPU (its rollout in
    its own process space: `HybridEngine` turns it on where that rollout keeps memory of its own, vLLM's)."""
    if not cfg.cluster.colocate:
        return False
    others = (cfg.uses_reference and cfg.model.lora is None) or cfg.critic is not None
    return not cfg.cluster.hybrid_engine or others


def training_spec(cfg: RunConfig, run: RunHandle, role: Role) -> GroupSpec:
    """Actor / critic / reference spec: one `PPOTrainer` per rank, built from the role's settings."""
    settings = trainer_settings(cfg, role)
    train = settings.train
    return GroupSpec(
        name=f"{run.name}-{run.key}-{role}",
        engine=TRAINING_ENGINE,
        kwargs={"settings": settings},
        num_workers=train.num_workers,
        tp=train.tp_size,
        pp=train.pp_size,
        num_gpus=cfg.cluster.gpus_per_worker if cfg.cluster.num_gpus else 0.0,
        resources=dict(cfg.cluster.trainer_resources),
        env=worker_gpu_env(cfg),
        threads=cfg.cluster.threads_per_worker,
        omp_passive=cfg.omp_passive,
        heap=cfg.cluster.heap,
    )


def reward_spec(cfg: RunConfig, run: RunHandle) -> GroupSpec:
    """The reward-function scorer (a process pool inside one actor), on the driver's node."""
    fns = [(f.name, f.weight, dict(f.kwargs)) for f in cfg.reward.functions]
    kwargs = {
        "functions": fns,
        "timeout_seconds": cfg.reward.timeout_seconds,
        "fallback_score": cfg.reward.fallback_score,
        "num_processes": cfg.reward.num_processes,
    }
    return GroupSpec(
        name=f"{run.name}-{run.key}-reward",
        engine=engine_path(REWARD_ENGINES, "functions"),
        kwargs=kwargs,
        beside_driver=True,  # (it reserves nothing, so Ray would put it on any node, one a spot reclaim can take)
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
    """One group whose ranks hold both the trainer and a rollout engine (`workers.hybrid.HybridEngine`)."""
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
        engine="rlstages.engines.workers.hybrid:HybridEngine",
        kwargs=kwargs,
        resources={**rollout.resources, **trainer.resources},
        env={**rollout.env, **trainer.env},
        extra_options=options,
    )
