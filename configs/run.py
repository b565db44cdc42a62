"""RunConfig: the one typed tree of a training run, with the cross-field checks that need several sections."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import Field, model_validator

from rlstages.configs.algorithm import AlgorithmConfig
from rlstages.configs.base import StrictModel
from rlstages.configs.cluster import ClusterConfig
from rlstages.configs.data import DataConfig
from rlstages.configs.evaluation import EvalConfig
from rlstages.configs.model import ModelConfig
from rlstages.configs.reward import RewardConfig
from rlstages.configs.rollout import RolloutConfig, rollout_tp
from rlstages.configs.stages import PrefectConfig
from rlstages.configs.trainer import AsyncConfig, TrainerConfig
from rlstages.configs.training import ReferenceConfig, TrainingConfig

GROUP_ESTIMATORS = {"grpo", "rloo", "reinforce_pp_baseline"}


class CheckpointConfig(StrictModel):
    """Every `every` steps and at the end; `keep` newest committed checkpoints are kept."""

    every: int = Field(default=0, ge=0, description="0 = only at the end.")
    keep: int = Field(default=2, ge=1)
    save_optimizer: bool = True
    commit_in_background: bool = Field(
        default=True,
        description="A checkpoint's commit (fsync, SHA-256 of every file, manifest, pruning) runs beside the next "
        "step once the engines have written their state; joined before the next checkpoint, a recovery and the "
        "export. false: the step loop waits for it.",
    )
    resume: Literal["auto", "fresh", "never"] = Field(
        default="auto",
        description="auto: an existing run directory continues from its last checkpoint; fresh: every flow run "
        "gets its own directory `<run_name>-<flow run id>` (a retry of that flow run resumes it); never: an "
        "existing run directory is an error.",
    )
    on_corrupt: Literal["error", "fallback"] = Field(
        default="error",
        description="A committed checkpoint whose files fail their checksums: error stops resume/eval naming it; "
        "fallback says so and uses the newest older checkpoint that verifies.",
    )


class TrackingConfig(StrictModel):
    """MLflow: where runs go and what is logged besides metrics."""

    tracking_uri: str | None = Field(
        default=None,
        description="MLflow tracking URI. Set here it wins; None = MLFLOW_TRACKING_URI, else sqlite:///mlflow.db.",
    )
    experiment: str = "rlstages"
    log_samples: int = Field(default=16, ge=0, description="Eval samples kept in the table per evaluation.")
    log_model: bool = Field(
        default=True,
        description="Log the final policy as an MLflow transformers model, from its directory (no load in the "
        "driver). The presets of models over 1B parameters turn it off.",
    )
    registered_model_name: str | None = Field(
        default=None,
        description="Register the logged policy under this name; alias `best` marks the version of the "
        "checkpoint with the best held-out reward, `latest` the final policy.",
    )
    outage_wait_s: float = Field(
        default=3600.0,
        ge=0,
        description="How long the end of a run waits for an MLflow or Prefect server that does not answer (its "
        "tracking calls are journaled in the run directory meanwhile; training does not wait). What is still "
        "unsent then stays in `tracking/journal.sqlite` and a resumed run sends it.",
    )


class RunConfig(StrictModel):
    """One training run, validated once in the driver before Ray starts."""

    model: ModelConfig
    data: DataConfig
    evaluation: EvalConfig = EvalConfig()
    rollout: RolloutConfig
    actor: TrainingConfig
    critic: TrainingConfig | None = None
    reference: ReferenceConfig = ReferenceConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    reward: RewardConfig
    trainer: TrainerConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    tracking: TrackingConfig = TrackingConfig()
    cluster: ClusterConfig = ClusterConfig()
    prefect: PrefectConfig = PrefectConfig()

    @property
    def uses_reference(self) -> bool:
        """The reference policy runs when a KL term needs it (or when forced on)."""
        if self.reference.enabled is not None:
            return self.reference.enabled
        return self.algorithm.use_kl_in_reward or self.algorithm.use_kl_loss

    @property
    def omp_passive(self) -> bool:
        """Whether worker OpenMP pools sleep at once: not when a lone hybrid worker does all the torch work."""
        policy = self.cluster.omp_wait_policy
        if policy != "auto":
            return policy == "passive"
        lone = self.cluster.hybrid_engine and self.actor.num_workers == 1
        return not (lone and self.critic is None and not self.uses_reference and self.reward.reward_model is None)

    @property
    def mini_batch_prompts(self) -> int:
        """Prompts per optimizer step."""
        return self.actor.mini_batch_size or self.data.prompts_per_step

    @property
    def needs_old_logprobs(self) -> bool:
        """Off-policy updates (several epochs or mini-batches) need a separate old-log-prob pass, and so do
        rollout IS weights and one-step-off-policy generation (pi_old is then not the rollout's policy)."""
        return (
            self.actor.ppo_epochs > 1
            or self.mini_batch_prompts < self.data.prompts_per_step
            or self.algorithm.behaviour_correction().level != "none"
            or self.trainer.overlaps_generation
        )

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        _check_algorithm(self)
        _check_workers(self)
        _check_batches(self)
        _check_layout(self)
        return self


def _check_algorithm(cfg: RunConfig) -> None:
    algo = cfg.algorithm
    if algo.adv_estimator in GROUP_ESTIMATORS and cfg.rollout.n < 2:
        raise ValueError(
            f"algorithm.adv_estimator={algo.adv_estimator} compares samples within a prompt's group, so it "
            f"needs rollout.n > 1 (got {cfg.rollout.n}); set rollout.n to 4-16"
        )
    if algo.adv_estimator == "gae" and cfg.critic is None:
        raise ValueError(
            "algorithm.adv_estimator=gae needs value estimates; add a `critic:` section "
            "(e.g. critic: {backend: torch}) or use grpo/rloo"
        )
    if algo.use_kl_in_reward and algo.use_kl_loss and not algo.allow_kl_in_reward_and_loss:
        raise ValueError(
            "algorithm.use_kl_in_reward and algorithm.use_kl_loss are both on, which penalises KL twice; "
            "turn one off or set algorithm.allow_kl_in_reward_and_loss: true"
        )
    if cfg.reference.enabled is False and (algo.use_kl_in_reward or algo.use_kl_loss):
        raise ValueError("a KL term is on but reference.enabled is false; the KL needs reference log-probs")
    if algo.clip_cov.lb >= algo.clip_cov.ub:
        raise ValueError(
            f"algorithm.clip_cov.lb={algo.clip_cov.lb} must be < algorithm.clip_cov.ub={algo.clip_cov.ub} "
            "(the covariance band of the tokens Clip-Cov may detach)"
        )
    if cfg.trainer.overlaps_generation and cfg.cluster.hybrid_engine:
        raise ValueError(
            f"trainer.mode={cfg.trainer.mode} overlaps generation with the update, so rollout and trainer must be "
            "separate workers: set cluster.hybrid_engine: false (or trainer.mode: sync)"
        )
    check_async(cfg)


def check_async(cfg: RunConfig) -> None:
    """Refuse async settings that cannot run as written (one line each, with the fix)."""
    a, mode = cfg.trainer.async_, cfg.trainer.mode
    defaults = AsyncConfig()  # a resolved config.yaml lists every field: only values off their defaults count
    changed = [k for k in sorted(a.model_fields_set) if getattr(a, k) != getattr(defaults, k)]
    if mode != "async" and changed:
        raise ValueError(
            f"trainer.async.{changed[0]} is set but trainer.mode={mode}; set trainer.mode: async "
            "(or remove the trainer.async section)"
        )
    if mode != "async":
        return
    if a.partial_rollout and cfg.rollout.multi_turn.enabled:
        raise ValueError(
            "trainer.async.partial_rollout streams single-turn text prompts only; rollout.multi_turn.enabled is "
            "true: set partial_rollout: false"
        )
    if a.kv_on_update == "keep" and not a.partial_rollout:
        raise ValueError(
            "trainer.async.kv_on_update=keep only matters with partial_rollout: true (without it no sequence "
            "spans a weight update); set partial_rollout: true or remove kv_on_update"
        )
    need = cfg.data.prompts_per_step
    if a.queue_capacity is not None and a.queue_capacity < need:
        raise ValueError(
            f"trainer.async.queue_capacity={a.queue_capacity} is smaller than one step's "
            f"data.prompts_per_step={need} prompt groups: the trainer could never take a batch; raise it"
        )


def _check_workers(cfg: RunConfig) -> None:
    for role, train in (("actor", cfg.actor), ("critic", cfg.critic)):
        if getattr(train, "bf16_stochastic_round", False) and cfg.model.dtype != "bfloat16":
            raise ValueError(
                f"{role}.bf16_stochastic_round rounds bf16 weights, but model.dtype={cfg.model.dtype}; "
                "set model.dtype: bfloat16 (or bf16_stochastic_round: false)"
            )


def _check_batches(cfg: RunConfig) -> None:
    prompts = cfg.data.prompts_per_step
    mini = cfg.mini_batch_prompts
    if prompts % mini:
        raise ValueError(
            f"actor.mini_batch_size={mini} must divide data.prompts_per_step={prompts} so every optimizer step "
            "sees the same number of prompts"
        )
    sequences = mini * cfg.rollout.n
    micro = cfg.actor.micro_batch_size
    if not cfg.actor.dynamic_batching and sequences % micro:
        raise ValueError(
            f"actor.micro_batch_size={micro} must divide a mini-batch of {sequences} sequences "
            f"(mini_batch_size {mini} x rollout.n {cfg.rollout.n}); or set actor.dynamic_batching: true"
        )


EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # qwen3_moe, mixtral, deepseek_v3


def _model_sizes(cfg: RunConfig) -> dict[str, int] | None:
    if cfg.model.architecture is not None:
        return cfg.model.architecture.model_dump()
    if cfg.model.tiny is not None and cfg.model.provider == "tiny-random":  # else the directory's config.json
        return cfg.model.tiny.model_dump()
    config_json = cfg.model.path / "config.json"
    if config_json.is_file():
        try:
            raw = json.loads(config_json.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None  # the pre-flight's model check names the file and what is wrong with it
        if not isinstance(raw, dict):
            return None
        if isinstance(raw.get("text_config"), dict):  # a vision-language model: its language model's sizes
            raw = {**raw, **raw["text_config"]}
        keys = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
        if all(k in raw for k in keys[:2]):
            raw.setdefault("num_key_value_heads", raw["num_attention_heads"])
            experts = next((raw[k] for k in EXPERT_KEYS if raw.get(k)), 0)
            return {**{k: int(raw[k]) for k in keys if k in raw}, "num_experts": int(experts)}
    return None


def _check_layout(cfg: RunConfig) -> None:
    sizes = _model_sizes(cfg)
    for role, train in (("actor", cfg.actor), ("critic", cfg.critic)):
        if train is not None and sizes is not None:
            train.check_model_layout(role, sizes)
    _check_gpus(cfg)


def gpu_slots(cfg: RunConfig) -> dict[str, int]:
    """GPU slots (ranks x their tensor-parallel width) each role of the layout needs; the hybrid engine's
    rollout lives in the actor's ranks, so it adds none of its own."""
    roles = {"actor": cfg.actor.num_workers}
    if not cfg.cluster.hybrid_engine:
        roles["rollout"] = cfg.rollout.num_workers * rollout_tp(cfg.rollout)
    if cfg.critic is not None:
        roles["critic"] = cfg.critic.num_workers
    if cfg.uses_reference:
        roles["reference"] = cfg.reference.num_workers
    return roles


def gpus_needed(cfg: RunConfig) -> float:
    """GPUs the layout takes: colocated roles share bundle i (max over roles), split roles add up."""
    slots = gpu_slots(cfg).values()
    per = cfg.cluster.gpus_per_worker
    return (max(slots) if cfg.cluster.colocate else sum(slots)) * per


def _check_gpus(cfg: RunConfig) -> None:
    cluster = cfg.cluster
    if cluster.hybrid_engine and (not cluster.colocate or cfg.rollout.num_workers != cfg.actor.num_workers):
        raise ValueError(
            "cluster.hybrid_engine puts each actor rank and a rollout engine in one process, so it needs "
            f"cluster.colocate: true and rollout.num_workers == actor.num_workers (got {cfg.rollout.num_workers} "
            f"and {cfg.actor.num_workers})"
        )
    if cluster.num_gpus == 0:
        return
    roles = gpu_slots(cfg)
    layout = ", ".join(f"{k}={v}" for k, v in roles.items())
    per = cluster.gpus_per_worker
    if cluster.placement_group is False and cluster.mode == "ray":
        alone = sum(roles.values()) * per
        raise ValueError(
            f"cluster.placement_group=false with cluster.num_gpus={cluster.num_gpus}: without placement groups "
            f"every role asks Ray for its own GPUs ({layout} GPU slots x {per:g} = {alone:g}), so colocated roles "
            "cannot share a GPU and a short cluster leaves actors pending forever; remove the setting (GPUs turn "
            "placement groups on) or set it to true"
        )
    needed = gpus_needed(cfg)
    if needed > cluster.num_gpus:
        mode = "colocated (max over roles)" if cluster.colocate else "split (sum over roles)"
        raise ValueError(
            f"not enough GPUs: need {needed:g}, have {cluster.num_gpus}: the layout asks for {needed:g} GPUs "
            f"({layout} GPU slots x {per:g} GPU, {mode}) but "
            f"cluster.num_gpus={cluster.num_gpus}; lower the worker counts or set cluster.colocate: true"
        )
