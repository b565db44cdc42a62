"""Config -> engine specs without starting anything: the trainer settings are the config's own pieces (no
copies), the derived step counts, the reference's defaults, and each backend's constructor arguments taken
from its registry entry. CPU only, no Ray."""

from __future__ import annotations

from pathlib import Path

from rlstages.configs import load_config
from rlstages.configs.training import DeepSpeedTrainingConfig, MegatronTrainingConfig, TorchTrainingConfig
from rlstages.engines.registry import ROLLOUT_BACKENDS, TRAINING_ENGINE
from rlstages.tasks.driver.context import RunHandle
from rlstages.tasks.driver.specs import rollout_spec, trainer_settings, training_spec

ROOT = Path(__file__).resolve().parents[3]
RUN = RunHandle("specs", "/tmp/specs")


def cfg(*overrides: str):
    return load_config(ROOT / "configs" / "tiny.yaml", ["model.provider=local", *overrides])


def test_settings_hold_the_config_sections_and_derive_the_step_counts() -> None:
    c = cfg(
        "actor.backend=deepspeed",
        "actor.zero_stage=3",
        "actor.ppo_epochs=2",
        "actor.mini_batch_size=2",
        "trainer.total_steps=5",
        "algorithm.entropy_coeff=0.01",
    )
    s = trainer_settings(c, "actor")
    assert s.train is c.actor and s.optim is c.actor.optim  # passed through, not copied field by field
    assert isinstance(s.train, DeepSpeedTrainingConfig) and s.train.zero_stage == 3
    assert s.num_mini_batches == 2 and s.optim_steps == 5 * 2 * 2
    assert s.loss.entropy_coeff == 0.01 and s.seed == c.trainer.seed
    # a colocated trainer hands its cached blocks back to the other processes on its GPU; alone it keeps them
    assert c.cluster.colocate and not c.cluster.hybrid_engine and s.shares_device
    assert not trainer_settings(cfg("cluster.colocate=false"), "actor").shares_device
    assert not trainer_settings(cfg("cluster.hybrid_engine=true"), "actor").shares_device  # rollout in-process
    hybrid_kl = cfg("cluster.hybrid_engine=true", "algorithm.use_kl_loss=true")
    assert trainer_settings(hybrid_kl, "actor").shares_device  # the reference's process shares the GPU
    spec = training_spec(c, RUN, "actor")
    assert spec.engine == TRAINING_ENGINE and spec.kwargs == {"settings": s}


def test_reference_runs_its_own_backend_at_its_defaults_with_the_actor_batching() -> None:
    c = cfg(
        "actor.backend=megatron",
        "actor.num_workers=2",
        "actor.tensor_model_parallel_size=2",
        "actor.dynamic_batching=true",
        "reference.backend=deepspeed",
        "reference.micro_batch_size=3",
        "algorithm.use_kl_loss=true",
    )
    ref = trainer_settings(c, "reference")
    assert (
        isinstance(ref.train, DeepSpeedTrainingConfig) and ref.train.zero_stage == DeepSpeedTrainingConfig().zero_stage
    )
    assert ref.train.micro_batch_size == 3 and ref.train.dynamic_batching and ref.converted_path is None
    actor = trainer_settings(c, "actor")
    assert isinstance(actor.train, MegatronTrainingConfig) and actor.converted_path is not None
    spec = training_spec(c, RUN, "actor")
    assert (spec.tp, spec.pp, spec.num_workers) == (2, 1, 2)
    ref_spec = training_spec(c, RUN, "reference")
    assert (ref_spec.tp, ref_spec.pp, ref_spec.num_workers) == (1, 1, 1)


def test_critic_takes_its_own_section() -> None:
    c = cfg("critic={backend: torch, micro_batch_size: 2}", "algorithm.adv_estimator=gae")
    s = trainer_settings(c, "critic")
    assert s.role == "critic" and isinstance(s.train, TorchTrainingConfig) and s.train is c.critic


def test_rollout_arguments_come_from_the_registry_entry() -> None:
    hf = rollout_spec(cfg(), RUN)
    assert hf.kwargs["batch_size"] == 64 and "seed" not in hf.kwargs and "model_type" in hf.kwargs
    v = cfg("rollout.backend=vllm", "rollout.max_model_len=512", "rollout.python=/usr/bin/python3")
    spec = rollout_spec(v, RUN)
    assert set(ROLLOUT_BACKENDS["vllm"].options) <= set(spec.kwargs) and spec.kwargs["max_model_len"] == 512
    assert spec.kwargs["seed"] == v.trainer.seed and "batch_size" not in spec.kwargs
    assert spec.extra_options  # vLLM's own interpreter for its actors


def test_trainer_and_rollout_workers_get_the_same_gpu_env() -> None:
    c = cfg("cluster.num_gpus=2", "cluster.nccl_cumem_enable=false", "cluster.cuda_device_max_connections=1")
    trainer, rollout = training_spec(c, RUN, "actor"), rollout_spec(c, RUN)
    assert trainer.env == rollout.env == {"NCCL_CUMEM_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert trainer.num_gpus == rollout.num_gpus == 1.0  # what the actor options ask Ray for
    assert training_spec(cfg("cluster.nccl_cumem_enable=true"), RUN, "actor").env == {}  # no GPUs: nothing set
