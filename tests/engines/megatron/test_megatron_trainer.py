"""The PPO trainer on the Megatron-Core backend against the torch backend on the same weights: log-probs, a GRPO step
(first Adam moments and moved weights), save/load that continues bitwise, HF export, critic, reference;
TP=1 in this process; TP=2, PP=2, uneven PP=2 (1 + 2 layers), DP=2 and PP=2 x VPP=2 as real Ray actor groups of
2 ranks over gloo.

Run: .venv/bin/python -m pytest tests/engines/megatron/test_megatron_trainer.py -q
Hardware: CPU only (torch CPU, megatron-core local spec + rlstages.engines.megatron.cuda_shim shim); starts a local Ray
with 2 CPUs and five 2-rank groups (TP=2, PP=2, uneven PP=2, DP=2, PP=2 x VPP=2); about 3 minutes on 2 cores.
Skipped without megatron-core.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from plan_check import check_group
from safetensors.torch import load_file

from rlstages.configs.training import MegatronTrainingConfig, OptimConfig, TorchTrainingConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.sync.buckets import decode_bucket
from rlstages.engines.training.core import PPOTrainer, without_perf
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams
from rlstages.engines.workers.actor_group import ActorGroup, GroupSpec
from tests.engines.compare import masked_max, max_diff

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")

ENGINE = "rlstages.engines.training.core:PPOTrainer"
PROMPTS = [Prompt(f"u{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
LR = 1e-4
# Adam's first step moves each element by lr * g / (|g| + eps): a gradient within float noise of zero can
# move by a fraction of lr (the torch side's fused AdamW rounds differently from megatron's torch AdamW: up to
# 2.3% of lr here), a gradient of the wrong sign moves by 2 lr. 5% of lr separates the two.
STEP_ATOL = 5e-2 * LR


def settings(
    path: Path,
    backend: str = "torch",
    converted_path: Path | None = None,
    role: str = "actor",
    loss: A.PolicyLossParams = A.PolicyLossParams(),
    lr: float = LR,
    **options,
) -> TrainerSettings:
    """Settings of a `backend` engine; `options` are its training config's fields (4 rows per micro-batch)."""
    options.setdefault("micro_batch_size", 4)
    config = MegatronTrainingConfig if backend == "megatron" else TorchTrainingConfig
    train = config(optim=OptimConfig(lr=lr, total_steps=10), **options)
    converted = str(converted_path) if converted_path is not None else None
    return TrainerSettings(str(path), role=role, train=train, loss=loss, converted_path=converted)  # type: ignore[arg-type]


def torch_engine(path: Path, **kw) -> PPOTrainer:
    return PPOTrainer(settings(path, **kw))


def setup_module() -> None:
    """Ship this module's helpers to Ray workers by value (test files are not importable there)."""
    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def batch(tiny_model_dir: Path):
    rollout = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    b = rollout.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=8), seed=3)  # rows of 1, 3 and 8 tokens
    # transformers gives the pad id's embedding row no gradient (padding_idx), megatron's embedding has none:
    # a sampled pad id would make their gradients differ there, so this batch must not hold one
    assert not (b[T.RESPONSE_IDS][b[T.RESPONSE_MASK].bool()] == rollout.pad_id).any()
    token = A.outcome_to_token_rewards((torch.arange(16) % 3 == 0).float(), b[T.RESPONSE_MASK])
    b[T.ADVANTAGES], b[T.RETURNS] = A.compute_advantages("grpo", token, b[T.RESPONSE_MASK], T.get_rows(b, "uid"))
    return b


@pytest.fixture(scope="module")
def converted(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from rlstages.engines.convert import convert_hf_to_mcore

    root = tmp_path_factory.mktemp("mcore")
    layouts = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
    return {k: convert_hf_to_mcore(tiny_model_dir, root / k, tp=tp, pp=pp) for k, (tp, pp) in layouts.items()}


@pytest.fixture(scope="module")
def torch_ref(tiny_model_dir: Path, batch) -> dict:
    """The torch backend's log-probs, weights before/after one GRPO step, metrics and first moments."""
    engine = torch_engine(tiny_model_dir)
    out = {"logprobs": engine.logprobs(batch), "before": snapshot(engine.named_weights())}
    out["metrics"] = engine.train_step(batch)
    out["after"] = snapshot(engine.named_weights())
    optimizer, model = engine.backend.optimizer, engine.backend.model
    assert optimizer is not None
    out["exp_avg"] = {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    return out


def snapshot(named) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in named}


def megatron(path: Path, converted_path: Path | None, **kw) -> PPOTrainer:
    return PPOTrainer(settings(path, "megatron", converted_path, **kw))


def hf_first_moments(engine) -> dict[str, torch.Tensor]:
    """Adam's exp_avg of a non-distributed megatron optimizer, in HF names (the converter maps any tensor)."""
    from rlstages.engines.convert import rank_mcore_to_hf

    backend = engine.backend
    inner = backend.optimizer.chained_optimizers[0].optimizer
    named = [(n, inner.state[p]["exp_avg"]) for n, p in backend.chunks[0].named_parameters()]
    return snapshot(rank_mcore_to_hf(named, backend.spec))


def check_against_torch(metrics: dict, torch_ref: dict) -> None:
    ref = torch_ref["metrics"]
    assert set(ref) <= set(metrics)
    assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert metrics["pg_loss"] == pytest.approx(ref["pg_loss"], abs=1e-6)
    assert metrics["entropy"] == pytest.approx(ref["entropy"], rel=1e-6)
    assert metrics["lr"] == ref["lr"] and metrics["logprob_diff"] < 1e-5


# ---- TP=1, in this process ----------------------------------------------------------------------------------
def test_tp1_logprobs_and_grpo_step_match_torch(tiny_model_dir: Path, converted, batch, torch_ref) -> None:
    engine = megatron(tiny_model_dir, converted["tp1"], use_distributed_optimizer=False)
    out, mask = engine.logprobs(batch), batch[T.RESPONSE_MASK]
    assert masked_max(out["logprobs"], torch_ref["logprobs"]["logprobs"], mask) <= 1e-5
    assert masked_max(out["entropy"], torch_ref["logprobs"]["entropy"], mask) <= 1e-5
    assert max_diff(snapshot(engine.named_weights()), torch_ref["before"]) == 0.0  # exact conversion
    check_against_torch(engine.train_step(batch), torch_ref)
    moments, ref = hf_first_moments(engine), torch_ref["exp_avg"]
    assert sorted(moments) == sorted(ref)
    for name in ref:  # (1 - beta1) x the clipped gradient
        assert torch.allclose(moments[name], ref[name], rtol=1e-4, atol=1e-9), name
    after = snapshot(engine.named_weights())
    assert max_diff(after, torch_ref["after"]) <= STEP_ATOL
    assert all(not torch.equal(after[k], torch_ref["before"][k]) for k in after)


def test_tp1_distributed_optimizer_save_load_continues_bitwise(
    tiny_model_dir: Path, converted, batch, torch_ref, tmp_path: Path
) -> None:
    engine = megatron(tiny_model_dir, converted["tp1"])  # use_distributed_optimizer=True (the config default)
    check_against_torch(engine.train_step(batch), torch_ref)
    assert max_diff(snapshot(engine.named_weights()), torch_ref["after"]) <= STEP_ATOL
    engine.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "mcore" / "metadata.json").is_file()
    m1, w1 = engine.train_step(batch), snapshot(engine.named_weights())
    restored = megatron(tiny_model_dir, converted["tp1"])
    restored.load(tmp_path / "ckpt")
    m2, w2 = restored.train_step(batch), snapshot(restored.named_weights())
    assert without_perf(m1) == without_perf(m2)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not torch.equal(w1["lm_head.weight"], torch_ref["after"]["lm_head.weight"])  # the second step moved


def test_export_round_trips_to_hf(tiny_model_dir: Path, converted, batch, tmp_path: Path) -> None:
    engine = megatron(tiny_model_dir, converted["tp1"])
    hf = load_file(str(tiny_model_dir / "model.safetensors"))
    exported = snapshot(engine.named_weights())
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in hf.items()}
    engine.train_step(batch)
    engine.save_pretrained(tmp_path / "hf", tokenizer_from=tiny_model_dir)
    reloaded = torch_engine(tmp_path / "hf")
    mask = batch[T.RESPONSE_MASK]
    assert masked_max(reloaded.logprobs(batch)["logprobs"], engine.logprobs(batch)["logprobs"], mask) <= 1e-5
    assert max_diff(snapshot(reloaded.named_weights()), snapshot(engine.named_weights())) == 0.0


def test_critic_and_reference(tiny_model_dir: Path, batch, tmp_path: Path) -> None:
    critic = megatron(tiny_model_dir, None, role="critic", lr=1e-3)  # converted in memory
    values = critic.values(batch)
    assert values.shape == batch[T.RESPONSE_IDS].shape
    b = batch.clone()
    b[T.VALUES], b[T.RETURNS] = values, torch.ones_like(values)
    first = critic.train_step(b)["vf_loss"]
    for _ in range(3):
        last = critic.train_step(b)["vf_loss"]
    assert last < first
    critic.save_pretrained(tmp_path / "critic")
    from transformers import AutoModelForTokenClassification

    from rlstages.engines.training import ppo_step as P

    hf_critic = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic"))
    with torch.no_grad():
        hf_values = P.value_forward(hf_critic, batch, False)
    assert masked_max(hf_values, critic.values(batch), batch[T.RESPONSE_MASK]) <= 1e-5
    reference = megatron(tiny_model_dir, None, role="reference")
    assert not any(p.requires_grad for c in reference.backend.chunks for p in c.parameters())
    with pytest.raises(RuntimeError, match="frozen"):
        reference.train_step(batch)


def test_unsupported_layouts_fail_clearly(tiny_model_dir: Path, converted) -> None:
    with pytest.raises(NotImplementedError, match="context_parallel_size"):
        megatron(tiny_model_dir, converted["tp1"], context_parallel_size=2, num_workers=2)
    with pytest.raises(ValueError, match="convert again"):
        megatron(tiny_model_dir, converted["tp2"])  # a TP=2 checkpoint for a TP=1 engine
    from rlstages.engines.megatron import parallel as MP

    both = {"num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 2}
    with pytest.raises(ValueError, match="need a middle stage"):  # megatron-core would divide by zero
        MegatronTrainingConfig(
            num_workers=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, **both
        )
    uneven = MP.Layout(pp=2, stages=(1, None))  # an evenly split checkpoint for an engine with uneven stages
    with pytest.raises(ValueError, match=r"stages=even .* stages=first=1,last=None"):
        MP.resolve_spec(converted["pp2"], tiny_model_dir, uneven, "local")


# ---- TP=2, PP=2, DP=2, VPP: Ray actor groups of 2 ranks ---------------------------------------------------------
def group_weights(group: ActorGroup, timeout: float = 120.0) -> dict[str, torch.Tensor]:
    """The weight-sync call pattern: every rank runs `weight_buckets` at once; the weight source (the group's
    `collect_ranks()[0]`) yields every HF tensor, the other ranks only take part and yield nothing."""
    import ray

    streams = [h.weight_buckets.options(num_returns="streaming").remote(1 << 20, "float32") for h in group.handles]
    source = group.collect_ranks()[0]
    out: dict[str, torch.Tensor] = {}
    for ref in streams[source]:
        out.update((k, v.clone()) for k, v in decode_bucket(ray.get(ref, timeout=timeout)))
    for rank, stream in enumerate(streams):
        if rank != source:
            assert not list(stream)
    return out


def run_group(name: str, path: Path, converted_path: Path, **kw) -> ActorGroup:
    spec = GroupSpec(
        name=name,
        engine=ENGINE,
        kwargs={"settings": settings(path, "megatron", converted_path, num_workers=2, **kw)},
        num_workers=2,
        tp=kw.get("tensor_model_parallel_size", 1),
        pp=kw.get("pipeline_model_parallel_size", 1),
    )
    return ActorGroup(spec, namespace="rlstages-tests")


def test_tp2_ray_group_matches_torch_and_resumes(
    ray_session, tiny_model_dir: Path, converted, batch, torch_ref, tmp_path: Path
) -> None:
    group = run_group("megatron-tp2", tiny_model_dir, converted["tp2"], tensor_model_parallel_size=2)
    try:
        mask = batch[T.RESPONSE_MASK]
        out = group.dp(300).logprobs(batch)
        assert masked_max(out["logprobs"], torch_ref["logprobs"]["logprobs"], mask) <= 1e-5
        assert max_diff(group_weights(group), torch_ref["before"]) == 0.0  # TP shards gathered to HF layouts
        check_against_torch(group.dp(300).train_step(batch), torch_ref)
        assert max_diff(group_weights(group), torch_ref["after"]) <= STEP_ATOL
        group.all(300).save(str(tmp_path / "ckpt"))
        m1, w1 = group.dp(300).train_step(batch), group_weights(group)
        group.all(300).load(str(tmp_path / "ckpt"))  # back to the saved state: the same step again
        m2, w2 = group.dp(300).train_step(batch), group_weights(group)
        assert without_perf(m1) == without_perf(m2) and all(torch.equal(w1[k], w2[k]) for k in w1)
        group.all(300).save_pretrained(str(tmp_path / "hf"), str(tiny_model_dir))
        exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
        assert max_diff(exported, w2) == 0.0 and (tmp_path / "hf" / "tokenizer_config.json").is_file()
        check_group(group, tiny_model_dir, batch, "megatron tp2")  # last: one more step
    finally:
        group.kill()


def test_pp2_ray_group_pipeline_schedule(ray_session, tiny_model_dir: Path, converted, batch, torch_ref) -> None:
    group = run_group("megatron-pp2", tiny_model_dir, converted["pp2"], pipeline_model_parallel_size=2)
    try:
        assert group.collect_ranks() == [1]
        first_stage, out = group.all(300).logprobs(batch)  # a pipeline: both stages run every call
        assert first_stage is None
        assert masked_max(out["logprobs"], torch_ref["logprobs"]["logprobs"], batch[T.RESPONSE_MASK]) <= 1e-5
        metrics = group.all(300).train_step(batch)
        assert without_perf(metrics[0]) == without_perf(metrics[1]) and math.isfinite(metrics[0]["grad_norm"])
        check_against_torch(metrics[1], torch_ref)
        assert max_diff(group_weights(group), torch_ref["after"]) <= STEP_ATOL  # both stages' tensors arrive
        check_group(group, tiny_model_dir, batch, "megatron pp2")
    finally:
        group.kill()


def test_dp2_ray_group_averages_gradients(ray_session, tiny_model_dir: Path, converted, batch) -> None:
    # seq-mean-token-mean over 8 + 8 rows: the mean of the two ranks' losses is the one-process loss
    loss = A.PolicyLossParams(loss_agg_mode="seq-mean-token-mean")
    ref = torch_engine(tiny_model_dir, loss=loss)
    ref_metrics, ref_after = ref.train_step(batch), snapshot(ref.named_weights())
    group = run_group("megatron-dp2", tiny_model_dir, converted["tp1"], loss=loss)  # distributed optimizer, DP=2
    try:
        assert group.collect_ranks() == [0, 1]
        per_rank = group.dp(300).train_step(batch)
        assert per_rank[0]["grad_norm"] == per_rank[1]["grad_norm"]
        assert per_rank[0]["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
        assert (per_rank[0]["pg_loss"] + per_rank[1]["pg_loss"]) / 2 == pytest.approx(ref_metrics["pg_loss"], abs=1e-6)
        assert max_diff(group_weights(group), ref_after) <= STEP_ATOL
        replica0, replica1 = group.all(300).logprobs(batch)  # both DP replicas took the same step
        assert torch.equal(replica0["logprobs"], replica1["logprobs"])
    finally:
        group.kill()


def test_pp2_uneven_stages_ray_group_matches_torch(ray_session, batch, tmp_path: Path) -> None:
    """num_layers_in_first_pipeline_stage=1 on 3 layers (stages of 1 + 2, as the MoE presets' uneven split):
    megatron-core builds and the converter fills the same layers on each stage; save / load continues bitwise."""
    from rlstages.engines.convert import convert_hf_to_mcore
    from rlstages.engines.models import build_tiny_model

    hf = build_tiny_model(tmp_path / "hf3", num_hidden_layers=3)
    ref = torch_engine(hf)
    ref_before = snapshot(ref.named_weights())
    ref_logprobs, ref_metrics = ref.logprobs(batch), ref.train_step(batch)
    mcore = convert_hf_to_mcore(hf, tmp_path / "mcore", pp=2, first_stage_layers=1)
    uneven = {"pipeline_model_parallel_size": 2, "num_layers_in_first_pipeline_stage": 1}
    group = run_group("megatron-uneven", hf, mcore, **uneven)
    try:
        _, out = group.all(300).logprobs(batch)
        assert masked_max(out["logprobs"], ref_logprobs["logprobs"], batch[T.RESPONSE_MASK]) <= 1e-5
        assert max_diff(group_weights(group), ref_before) == 0.0  # stage 1 exports layers 1 and 2 under HF names
        metrics = group.all(300).train_step(batch)
        assert metrics[1]["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
        assert max_diff(group_weights(group), snapshot(ref.named_weights())) <= STEP_ATOL
        group.all(300).save(str(tmp_path / "ckpt"))  # dist checkpoint keys: global layer numbers from the offsets
        m1, w1 = group.all(300).train_step(batch)[1], group_weights(group)
        group.all(300).load(str(tmp_path / "ckpt"))
        m2, w2 = group.all(300).train_step(batch)[1], group_weights(group)
        assert without_perf(m1) == without_perf(m2) and all(torch.equal(w1[k], w2[k]) for k in w1)
    finally:
        group.kill()


def test_pp2_vpp2_ray_group_interleaved_schedule(ray_session, batch, tmp_path: Path) -> None:
    from rlstages.engines.convert import convert_hf_to_mcore
    from rlstages.engines.models import build_tiny_model

    hf = build_tiny_model(tmp_path / "hf4", num_hidden_layers=4)  # 2 stages x 2 virtual chunks x 1 layer
    ref = torch_engine(hf)
    ref_logprobs, ref_metrics = ref.logprobs(batch), ref.train_step(batch)
    mcore = convert_hf_to_mcore(hf, tmp_path / "mcore", pp=2, vpp=2)
    group = run_group("megatron-vpp", hf, mcore, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    try:
        out = group.dp(300).logprobs(batch)
        assert masked_max(out["logprobs"], ref_logprobs["logprobs"], batch[T.RESPONSE_MASK]) <= 1e-5
        metrics = group.dp(300).train_step(batch)
        assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
        assert max_diff(group_weights(group), snapshot(ref.named_weights())) <= STEP_ATOL
    finally:
        group.kill()


def test_tp1_memory_matches_the_plan(tiny_model_dir: Path, converted, batch) -> None:
    """The memory plan (`rlstages plan`) of this engine's config against its tensors after a step: weights, the
    DDP's fp32 gradient buffer and the distributed optimizer's Adam states (fp32 weights: no master copy)."""
    import json

    from rlstages.configs import load_config
    from rlstages.tasks.driver.memory_plan import plan

    engine = megatron(tiny_model_dir, converted["tp1"])  # use_distributed_optimizer=True, DP 1
    engine.train_step(batch)
    backend = engine.backend
    params = [p for chunk in backend.chunks for p in chunk.parameters()]
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for m in backend.models for b in m.buffers)
    states = [
        t
        for sub in getattr(backend.optimizer, "chained_optimizers", [backend.optimizer])
        for state in sub.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    ]
    root = Path(__file__).resolve().parents[3]
    cfg = load_config(
        root / "configs" / "tiny.yaml",
        [f"model.path={tiny_model_dir}", "actor={backend: megatron, micro_batch_size: 4}"],
    )
    rank = plan(cfg, json.loads((tiny_model_dir / "config.json").read_text())).fullest
    assert rank.params == sum(p.numel() for p in params)
    assert rank.gpu["weights"] == sum(p.numel() * p.element_size() for p in params)
    assert rank.gpu["grads"] == pytest.approx(grads, rel=0.02)  # the buffer pads to its alignment
    assert rank.gpu["optimizer"] == pytest.approx(sum(t.numel() * t.element_size() for t in states), rel=0.02)
