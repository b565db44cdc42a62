"""A tiny Qwen3-MoE on the Megatron-Core backend against the torch backend (the HF model) on the same weights.

EP=2 as a real Ray actor group of 2 ranks over gloo (experts split 2 + 2, tokens through megatron's alltoall
dispatcher): log-probs within the dense tolerance, the HF export bit-exact (experts gathered over the EP group),
one GRPO step with the same metrics and the same moved weights, `moe/*` metrics; a `dist_checkpointing` save at
EP=2 loaded by an EP=1 engine in this process (resharded) gives the same weights bit for bit and log-probs, and
Adam's moments and step as an EP=1 engine's own first step (megatron-core's fully-reshardable optimizer format).
TP2 x EP2 with expert TP 1 (the presets' ETP=1) as a second 2-rank group: the same log-probs, GRPO step (sequence
parallel, torch norms) and HF export, then it loads a 1-rank TP1 / EP1 engine's checkpoint (EP 1 -> 2): the weights
bit for bit and every rank's Adam moments and step as saved.
A 1-rank EP1 checkpoint of a tiny DeepSeek-V3 loads into a 4-rank TP2 x PP2 x EP2 group whose first stage holds no
experts (an empty expert optimizer there). In this process at EP=1: the router options reach megatron-core (aux /
z-loss tracked, their gradient reaching the router), and a dense model at EP > 1 is refused.

Run: .venv/bin/python -m pytest tests/engines/megatron/test_megatron_moe.py -q
Hardware: CPU only (megatron-core local spec, SequentialMLP experts, gloo); 2-rank and 4-rank Ray groups; ~2 min.
Skipped without megatron-core.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from plan_check import check_group

from rlstages.configs.megatron_training import MegatronTrainingConfig, MoERouterConfig
from rlstages.configs.training import OptimConfig, TorchTrainingConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.sync.buckets import decode_bucket
from rlstages.engines.training.core import PPOTrainer
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams
from rlstages.engines.workers.actor_group import ActorGroup, GroupSpec
from tests.engines.compare import masked_max, max_diff

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")

ENGINE = "rlstages.engines.training.core:PPOTrainer"
PROMPTS = [Prompt(f"u{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
LR = 1e-4
LOSS = A.PolicyLossParams(loss_agg_mode="seq-mean-token-mean")  # EP=2 is DP=2: the mean of 8 + 8 rows' losses
STEP_ATOL = 5e-2 * LR  # as the dense tests: a wrong-signed gradient moves an element by 2 lr, float noise < 3% lr


def settings(
    path: Path, backend: str = "torch", converted: Path | None = None, role: str = "actor", **options
) -> TrainerSettings:
    options.setdefault("micro_batch_size", 4)
    config = MegatronTrainingConfig if backend == "megatron" else TorchTrainingConfig
    train = config(optim=OptimConfig(lr=LR, total_steps=10), **options)
    converted_path = str(converted) if converted else None
    return TrainerSettings(str(path), role=role, train=train, loss=LOSS, converted_path=converted_path)  # type: ignore[arg-type]


def setup_module() -> None:
    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def snapshot(named) -> dict[str, torch.Tensor]:
    """HF tensors by name (both backends yield MoE experts in the on-disk layout, one tensor per expert)."""
    return {k: v.detach().clone() for k, v in named}


@pytest.fixture(scope="module")
def batch(tiny_moe_dir: Path):
    rollout = HFRolloutEngine(tiny_moe_dir, dtype="float32", apply_chat_template=False)
    b = rollout.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=8), seed=3)
    assert not (b[T.RESPONSE_IDS][b[T.RESPONSE_MASK].bool()] == rollout.pad_id).any()  # see the dense tests
    token = A.outcome_to_token_rewards((torch.arange(16) % 3 == 0).float(), b[T.RESPONSE_MASK])
    b[T.ADVANTAGES], b[T.RETURNS] = A.compute_advantages("grpo", token, b[T.RESPONSE_MASK], T.get_rows(b, "uid"))
    return b


@pytest.fixture(scope="module")
def torch_ref(tiny_moe_dir: Path, batch) -> dict:
    engine = PPOTrainer(settings(tiny_moe_dir))
    out = {"logprobs": engine.logprobs(batch), "before": snapshot(engine.named_weights())}
    out["metrics"] = engine.train_step(batch)
    out["after"] = snapshot(engine.named_weights())
    return out


def group_weights(group: ActorGroup) -> dict[str, torch.Tensor]:
    import ray

    streams = [h.weight_buckets.options(num_returns="streaming").remote(1 << 20, "float32") for h in group.handles]
    source = group.collect_ranks()[0]
    out: dict[str, torch.Tensor] = {}
    for ref in streams[source]:
        out.update((k, v.clone()) for k, v in decode_bucket(ray.get(ref, timeout=120)))
    for rank, stream in enumerate(streams):
        if rank != source:
            assert not list(stream)
    return out


def test_ep2_ray_group_matches_torch_and_reshards_to_ep1(
    ray_session, tiny_moe_dir: Path, batch, torch_ref, tmp_path: Path
) -> None:
    from rlstages.engines.convert import convert_hf_to_mcore

    converted = convert_hf_to_mcore(tiny_moe_dir, tmp_path / "mcore-ep2", ep=2)
    assert (converted / "mp_rank_00_001" / "model.safetensors").is_file()  # EP rank 1's experts
    engine_settings = settings(tiny_moe_dir, "megatron", converted, num_workers=2, expert_model_parallel_size=2)
    spec = GroupSpec(name="megatron-ep2", engine=ENGINE, kwargs={"settings": engine_settings}, num_workers=2)
    group = ActorGroup(spec, namespace="rlstages-tests")
    try:
        assert group.collect_ranks() == [0, 1]  # EP ranks are data-parallel replicas of the dense part
        mask = batch[T.RESPONSE_MASK]
        out = group.dp(300).logprobs(batch)
        assert masked_max(out["logprobs"], torch_ref["logprobs"]["logprobs"], mask) <= 1e-5
        assert masked_max(out["entropy"], torch_ref["logprobs"]["entropy"], mask) <= 1e-5
        exported = group_weights(group)
        assert max_diff(exported, torch_ref["before"]) == 0.0  # every expert back from its EP rank
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in exported
        per_rank = group.dp(300).train_step(batch)
        ref = torch_ref["metrics"]
        assert per_rank[0]["grad_norm"] == per_rank[1]["grad_norm"]
        assert per_rank[0]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert (per_rank[0]["pg_loss"] + per_rank[1]["pg_loss"]) / 2 == pytest.approx(ref["pg_loss"], abs=1e-6)
        imbalance = per_rank[0]["moe/tokens_per_expert_imbalance"]
        assert imbalance == per_rank[1]["moe/tokens_per_expert_imbalance"] and 1.0 <= imbalance <= 4.0
        assert "moe/aux_loss" not in per_rank[0]  # coefficient 0 by default: not tracked
        after = group_weights(group)
        assert max_diff(after, torch_ref["after"]) <= STEP_ATOL
        assert all(not torch.equal(after[k], torch_ref["before"][k]) for k in after)  # every expert moved
        group.all(300).save(str(tmp_path / "ckpt"))
        logprobs_ep2 = group.dp(300).logprobs(batch)["logprobs"]
        check_group(group, tiny_moe_dir, batch, "megatron ep2")  # last: one more step
    finally:
        group.kill()
    # EP=1 in this process, converted in memory, loads the EP=2 dist checkpoint: the model resharded bit for bit,
    # the optimizer (EP=2 chains a dense and an expert optimizer; EP=1 has one) through megatron-core's
    # fully-reshardable, model-space format: Adam's moments and step as an EP=1 engine's own first step has them
    single = PPOTrainer(settings(tiny_moe_dir, "megatron"))
    single.load(tmp_path / "ckpt")
    assert max_diff(snapshot(single.named_weights()), after) == 0.0  # resharded EP 2 -> 1 bit for bit
    assert masked_max(single.logprobs(batch)["logprobs"], logprobs_ep2, mask) <= 1e-5
    own = PPOTrainer(settings(tiny_moe_dir, "megatron"))
    own.train_step(batch)
    loaded, expected = adam_state(single), adam_state(own)
    assert sorted(loaded) == sorted(expected) and any(".experts." in k for k in loaded)
    for name, (m, v, step) in expected.items():
        assert loaded[name][2] == step == 1.0, name
        assert torch.allclose(loaded[name][0], m, rtol=1e-4, atol=1e-4 * float(m.abs().max())), name
        assert torch.allclose(loaded[name][1], v, rtol=1e-3, atol=1e-3 * float(v.abs().max())), name


def adam_state(engine: PPOTrainer) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """(exp_avg, exp_avg_sq, step) of every parameter of a one-rank Megatron engine, by Megatron name (the
    distributed optimizer's main params are flat views: reshaped to the parameter's shape)."""
    backend = engine.backend
    out = {}
    for sub in backend.optimizer.chained_optimizers:
        for name, param in backend.chunks[0].named_parameters():
            if param not in sub.model_param_group_index_map:
                continue
            group, order = sub.model_param_group_index_map[param]
            state = sub.optimizer.state[sub.optimizer.param_groups[group]["params"][order]]
            moments = [state[k].detach().clone().reshape(param.shape) for k in ("exp_avg", "exp_avg_sq")]
            out[name] = (*moments, float(state["step"]))
    return out


def test_router_options_reach_megatron(tiny_moe_dir: Path, batch) -> None:
    plain = PPOTrainer(settings(tiny_moe_dir, "megatron")).train_step(batch)
    moe = MoERouterConfig(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    aux = PPOTrainer(settings(tiny_moe_dir, "megatron", moe=moe))
    config = aux.backend.chunks[0].config
    assert (config.moe_aux_loss_coeff, config.moe_z_loss_coeff, config.moe_router_topk) == (0.1, 0.01, 2)
    assert config.moe_expert_capacity_factor is None and config.moe_token_dispatcher_type == "alltoall"
    metrics = aux.train_step(batch)
    assert 0.5 < metrics["moe/aux_loss"] < 4.0  # switch loss: 1.0 when balanced, num_experts at worst
    assert metrics["moe/z_loss"] > 0 and math.isfinite(metrics["moe/tokens_per_expert_imbalance"])
    assert metrics["pg_loss"] == plain["pg_loss"]  # the policy loss is the same ...
    assert abs(metrics["grad_norm"] - plain["grad_norm"]) > 1e-6 * plain["grad_norm"]  # ... the aux losses add to it


def test_dense_model_at_ep2_is_refused(tiny_model_dir: Path) -> None:
    from rlstages.configs import load_config

    root = Path(__file__).resolve().parents[3]
    overrides = [f"model.path={tiny_model_dir}", "model.provider=local", "model.tiny=null"]
    overrides += ["actor.backend=megatron", "actor.num_workers=2", "actor.expert_model_parallel_size=2"]
    with pytest.raises(ValueError, match="expert_model_parallel_size=2: the model is dense"):
        load_config(root / "configs" / "tiny.yaml", overrides)


def rank_view(engine: PPOTrainer, adam: bool = False) -> dict:
    """Inside a group rank: its coordinates, whether the sequence is split over TP, its parameter shapes and Adam
    state (DP=1: the distributed optimizer holds every parameter of this rank whole)."""
    from megatron.core import parallel_state as ps

    backend = engine.backend
    return {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "sequence_parallel": backend.chunks[0].config.sequence_parallel,
        "shapes": {n: tuple(p.shape) for n, p in backend.chunks[0].named_parameters()},
        "adam": adam_state(engine) if adam else {},
    }


def expected_shard(name: str, saved: dict, tp_rank: int, ep_rank: int, spec) -> torch.Tensor:
    """The TP1 / EP1 saver's tensor of `name` as TP rank `tp_rank` / EP rank `ep_rank` holds it: a routed expert
    whole (expert TP 1) from its global index, a dense tensor's TP shard (the converter's split), the rest as is."""
    from rlstages.engines.convert.sharding import global_expert_name, split_tp, tp_kind

    if ".experts." in name:
        return saved[global_expert_name(name, ep_rank, spec.experts_per_rank)]
    shards = split_tp(name, saved[name], tp_kind(name, spec.template.tp_rules), spec.tp)
    return torch.as_tensor(shards[tp_rank])


def test_tp2_ep2_etp1_ray_group_matches_torch_and_loads_ep1(
    ray_session, tiny_moe_dir: Path, batch, torch_ref, tmp_path: Path
) -> None:
    """TP2 x EP2 with expert TP 1 in 2 ranks (the 235B / 671B presets' ETP=1 in miniature): each rank holds half of
    every dense TP shard and 2 of the 4 experts at full width; the same log-probs, GRPO step and HF export as the
    torch backend; then it loads a checkpoint of a 1-rank TP1 / EP1 engine (EP 1 -> 2, TP 1 -> 2 reshard)."""
    import ray

    from rlstages.engines.convert import ConversionSpec, convert_hf_to_mcore

    converted = convert_hf_to_mcore(tiny_moe_dir, tmp_path / "mcore-etp1", tp=2, ep=2, etp=1)
    conv = ConversionSpec.load(converted)
    assert conv.expert_tp == 1
    saver = PPOTrainer(settings(tiny_moe_dir, "megatron"))  # TP1 / EP1 in this process: one step, then saved
    saver.train_step(batch)
    saver.save(tmp_path / "ckpt-ep1")
    saved_weights, saved_adam = snapshot(saver.named_weights()), adam_state(saver)
    layout = {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}
    engine_settings = settings(tiny_moe_dir, "megatron", converted, num_workers=2, **layout)
    spec = GroupSpec(name="megatron-etp1", engine=ENGINE, kwargs={"settings": engine_settings}, num_workers=2, tp=2)
    group = ActorGroup(spec, namespace="rlstages-tests")
    try:
        views = ray.get([h.__ray_call__.remote(rank_view) for h in group.handles], timeout=120)
        assert [(v["tp_rank"], v["ep_rank"]) for v in views] == [(0, 0), (1, 1)]  # expert rank order: ETP, then EP
        assert all(v["sequence_parallel"] for v in views)  # megatron-core trains MoE under TP only with it
        shapes = views[0]["shapes"]
        whole = (2 * conv.mcore["moe_ffn_hidden_size"], conv.mcore["hidden_size"])  # gate + up, not split over TP
        assert shapes["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"] == whole
        assert shapes["decoder.layers.0.self_attention.linear_proj.weight"][1] * 2 == conv.mcore["hidden_size"]
        mask = batch[T.RESPONSE_MASK]
        out = group.dp(300).logprobs(batch)
        assert masked_max(out["logprobs"], torch_ref["logprobs"]["logprobs"], mask) <= 1e-5
        assert masked_max(out["entropy"], torch_ref["logprobs"]["entropy"], mask) <= 1e-5
        assert max_diff(group_weights(group), torch_ref["before"]) == 0.0  # experts over EP, dense over TP
        metrics = group.dp(300).train_step(batch)  # DP=1: the one data rank's metrics
        ref = torch_ref["metrics"]
        assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert metrics["pg_loss"] == pytest.approx(ref["pg_loss"], abs=1e-6)
        after = group_weights(group)
        assert max_diff(after, torch_ref["after"]) <= STEP_ATOL
        assert all(not torch.equal(after[k], torch_ref["before"][k]) for k in after)  # every weight moved
        # EP 1 -> 2 (and TP 1 -> 2): the 1-rank engine's checkpoint, weights bit for bit, Adam state as saved
        group.all(300).load(str(tmp_path / "ckpt-ep1"))
        assert max_diff(group_weights(group), saved_weights) == 0.0
        views = ray.get([h.__ray_call__.remote(rank_view, True) for h in group.handles], timeout=120)
        check_group(group, tiny_moe_dir, batch, "megatron tp2 x ep2")  # last: one more step
    finally:
        group.kill()
    routed = len([n for n in saved_adam if ".experts." in n])
    for view in views:
        assert len(view["adam"]) == len(saved_adam) - routed // 2  # all dense tensors, half of the experts
        for name, (m, v, step) in view["adam"].items():
            assert step == 1.0, name
            for got, index in ((m, 0), (v, 1)):
                saved = {k: t[index] for k, t in saved_adam.items()}
                assert torch.equal(got, expected_shard(name, saved, view["tp_rank"], view["ep_rank"], conv)), name


def test_ep1_checkpoint_loads_where_a_stage_holds_no_experts(
    ray_session, tiny_deepseek_dir: Path, tmp_path: Path
) -> None:
    """A 1-rank EP1 checkpoint of a tiny DeepSeek-V3 loads into TP2 x PP2 x EP2 (expert TP 1) whose first stage is
    the dense first layer alone: that stage's expert optimizer holds no parameters (megatron-core aligns the param
    groups over ranks) and loads no tensors; every rank gets the saved weights bit for bit and Adam step 1."""
    import ray

    from rlstages.engines.convert import convert_hf_to_mcore

    rollout = HFRolloutEngine(tiny_deepseek_dir, dtype="float32", apply_chat_template=False)
    b = rollout.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=8), seed=3)
    token = A.outcome_to_token_rewards((torch.arange(16) % 3 == 0).float(), b[T.RESPONSE_MASK])
    b[T.ADVANTAGES], b[T.RETURNS] = A.compute_advantages("grpo", token, b[T.RESPONSE_MASK], T.get_rows(b, "uid"))
    saver = PPOTrainer(settings(tiny_deepseek_dir, "megatron"))
    saver.train_step(b)
    saver.save(tmp_path / "ckpt-ep1")
    saved = snapshot(saver.named_weights())
    layout = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}
    layout |= {"expert_tensor_parallel_size": 1, "num_layers_in_first_pipeline_stage": 1}
    converted = convert_hf_to_mcore(tiny_deepseek_dir, tmp_path / "m", tp=2, pp=2, ep=2, etp=1, first_stage_layers=1)
    engine_settings = settings(tiny_deepseek_dir, "megatron", converted, num_workers=4, **layout)
    kwargs = {"settings": engine_settings}
    spec = GroupSpec(name="megatron-dsv3", engine=ENGINE, kwargs=kwargs, num_workers=4, tp=2, pp=2)
    group = ActorGroup(spec, namespace="rlstages-tests")
    try:
        group.all(600).load(str(tmp_path / "ckpt-ep1"))
        assert max_diff(group_weights(group), saved) == 0.0
        views = ray.get([h.__ray_call__.remote(rank_view, True) for h in group.handles], timeout=120)
    finally:
        group.kill()
    assert all(step == 1.0 for view in views for (_, _, step) in view["adam"].values())
    assert all(view["adam"] for view in views)
