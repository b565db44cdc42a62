"""The PPO trainer on the DeepSpeed backend against the torch backend: log-probs, one GRPO step under
ZeRO 1/2/3 (also with dynamic batching and CPU offload), ZeRO-3 gathered weights and export, save/load that
continues bitwise from a renamed directory, critic, reference, mixed precision, and a 2-rank ZeRO-2/3
data-parallel group on Ray (image batches: test_deepspeed_vlm.py; shared helpers: deepspeed_support.py).

CPU only, real DeepSpeed (skipped when it is not installed): `.venv/bin/python -m pytest -q
tests/engines/training/test_deepspeed_trainer.py`. The first run JIT-builds DeepSpeed's `cpu_adam` (~80 s) for the
offload tests into TORCH_EXTENSIONS_DIR (default: torch's own cache, one folder per venv,
`~/.cache/torch_extensions/py3X_cpu-HASH`: deepspeed_support.py); later runs load the cached build. The product
skips `deepspeed_shm_comm` on CPUs (engines/training/deepspeed_backend.py): it is never built.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from deepspeed_support import (  # noqa: E402
    EXT_DIR,
    OPTIM,
    ds,
    one_process_group,  # noqa: F401 (the module's autouse fixture)
    rank_weights,
    settings,
    ship_to_ray,
    snapshot,
    torch_engine,
)
from plan_check import check_group  # noqa: E402

from rlstages.engines import algorithms as A  # noqa: E402
from rlstages.engines import types as T  # noqa: E402
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine  # noqa: E402
from rlstages.engines.sync.buckets import decode_bucket  # noqa: E402
from rlstages.engines.training.core import without_perf  # noqa: E402
from rlstages.engines.types import Prompt, SamplingParams  # noqa: E402
from rlstages.engines.workers.actor_group import ActorGroup, GroupSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [Prompt(f"u{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]


def setup_module() -> None:
    """Ship this module's helper functions to Ray workers by value (test files are not importable there)."""
    ship_to_ray(sys.modules[__name__])


@pytest.fixture(scope="module")
def batch(tiny_model_dir: Path):
    rollout = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    b = rollout.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=8), seed=0)
    scores = (torch.arange(16) % 3 == 0).float()
    token = A.outcome_to_token_rewards(scores, b[T.RESPONSE_MASK])
    adv, ret = A.compute_advantages("grpo", token, b[T.RESPONSE_MASK], T.get_rows(b, "uid"))
    b[T.ADVANTAGES], b[T.RETURNS] = adv, ret
    b[T.VALUES] = torch.zeros_like(adv)
    return b


@pytest.fixture(scope="module")
def wide_model_dir(session_tmp: Path) -> Path:
    """The tiny model widened so ZeRO-3 really partitions: embeddings and MLP matrices (131k elements) exceed
    DeepSpeed's 1e5 persistence threshold (smaller tensors stay whole on every rank). Same tokenizer."""
    from rlstages.engines.models import build_tiny_model

    path = session_tmp / "wide-qwen2"
    if not (path / "config.json").is_file():
        build_tiny_model(path, hidden_size=256, intermediate_size=512)
    return path


@pytest.fixture(scope="module")
def model_for(tiny_model_dir: Path, wide_model_dir: Path):
    """The model a ZeRO stage is tested on: the wide one for stage 3."""
    return lambda stage: wide_model_dir if stage == 3 else tiny_model_dir


@pytest.fixture(scope="module")
def torch_step(batch):
    """The torch backend after one GRPO step, per model: its metrics, weights and Adam first moments by name."""
    cache: dict[Path, tuple] = {}

    def get(path: Path) -> tuple:
        if path not in cache:
            engine = torch_engine(path)
            metrics = engine.train_step(batch)
            optimizer, model = engine.backend.optimizer, engine.backend.model
            assert optimizer is not None
            exp_avg = {n: optimizer.state[p]["exp_avg"] for n, p in model.named_parameters()}
            cache[path] = (metrics, dict(engine.named_weights()), exp_avg)
        return cache[path]

    return get


@pytest.mark.parametrize("stage", [2, 3])
def test_logprobs_equal_torch_backend(model_for, batch, stage: int) -> None:
    expected = torch_engine(model_for(stage)).logprobs(batch)
    got = ds(model_for(stage), zero_stage=stage).logprobs(batch)
    assert torch.allclose(got["logprobs"], expected["logprobs"], atol=1e-5, rtol=0)
    assert torch.allclose(got["entropy"], expected["entropy"], atol=1e-5, rtol=0)


STEP_CASES = {
    "zero1": {"zero_stage": 1},
    "zero2-dynamic": {"zero_stage": 2, "dynamic_batching": True, "max_tokens_per_micro_batch": 40},  # 2-3 rows each
    "zero3": {"zero_stage": 3},
    "zero2-offload": {"zero_stage": 2, "offload_optimizer": True},
    "zero3-offload": {"zero_stage": 3, "offload_optimizer": True, "offload_param": True},
}


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_grpo_step_matches_torch_backend(model_for, batch, torch_step, case: str) -> None:
    """Same gradient as the torch backend: the Adam first moment ((1 - beta1) x the clipped gradient, up to 8e-3
    here) agrees to 1e-8 + 1e-5 relative, i.e. float32 rounding of the accumulated micro-batch sums (ZeRO-3's
    embedding moment, up to 3.9e-3, differed by 1.02e-8 with this round's packages: transformers 5.24,
    deepspeed 0.19.8; a wrong gradient differs by its own size, ~1e-3). The weights agree to 1e-4 = lr / 100:
    Adam's first update is lr x g / (|g| + eps), which amplifies rounding where |g| is near eps."""
    from deepspeed.utils import safe_get_full_optimizer_state

    path = model_for(STEP_CASES[case]["zero_stage"])
    ref_metrics, ref_weights, ref_exp_avg = torch_step(path)
    engine = ds(path, **STEP_CASES[case])
    metrics = engine.train_step(batch)
    assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
    assert metrics["lr"] == ref_metrics["lr"] and metrics["pg_loss"] == pytest.approx(ref_metrics["pg_loss"], abs=1e-7)
    for name, param in engine.backend.module.named_parameters():
        exp_avg = safe_get_full_optimizer_state(param, "exp_avg")
        assert torch.allclose(exp_avg.view_as(ref_exp_avg[name]), ref_exp_avg[name], atol=1e-8, rtol=1e-5), name
    weights = dict(engine.named_weights())
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in ref_weights.items()}
    assert all(torch.allclose(weights[k], ref_weights[k], atol=1e-4, rtol=0) for k in ref_weights)


def test_zero3_step_through_the_fused_decoder_kernels_matches_torch(model_for, batch, monkeypatch) -> None:
    """ZeRO-3 with the decoder's RMSNorm, SwiGLU and rotary routed to the compiled functions (what a GPU's
    DeepSpeed trainer runs, `fused_layers`; traced here with aot_eager, parameters gathered by ZeRO's hooks
    before each routed forward) takes the torch backend's step on transformers' own code: same gradient, same
    weights."""
    from rlstages.engines.models import fused_layers as FL

    path = model_for(3)
    reference = torch_engine(path, fuse_elementwise=False)  # transformers' code: not `lean_layers`' CPU backward
    ref_metrics, ref_weights = reference.train_step(batch), dict(reference.named_weights())
    torch._dynamo.reset()
    monkeypatch.setattr(FL.KERNELS, "devices", ("cpu",))
    monkeypatch.setattr(FL.KERNELS, "backend", "aot_eager")
    monkeypatch.setattr(FL.KERNELS, "compiled", {})
    monkeypatch.setattr(FL.KERNELS, "failed", set())
    engine = ds(path, zero_stage=3)
    metrics = engine.train_step(batch)
    assert sorted(FL.KERNELS.compiled) == ["rms_norm", "rotary", "swiglu"] and not FL.KERNELS.failed
    assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
    weights = dict(engine.named_weights())
    assert all(torch.allclose(weights[k], ref_weights[k], atol=1e-4, rtol=0) for k in ref_weights)


def test_scheduler_steps_once_per_optimizer_step(tiny_model_dir: Path, batch) -> None:
    engine = ds(tiny_model_dir, zero_stage=2, num_mini_batches=2, ppo_epochs=2)
    reference = torch_engine(tiny_model_dir, num_mini_batches=2, ppo_epochs=2)
    b = batch.clone()
    b[T.OLD_LOGPROBS] = engine.logprobs(batch)["logprobs"]
    metrics, expected = engine.train_step(b), reference.train_step(b)
    scheduler = engine.backend.scheduler
    assert scheduler is not None and scheduler.last_epoch == 4  # 2 epochs x 2 mini-batches
    assert metrics["lr"] == expected["lr"] and metrics["ppo_kl"] == pytest.approx(expected["ppo_kl"], abs=1e-6)
    assert metrics["ppo_kl"] != 0.0  # later mini-batches saw a moved policy


def test_zero3_partitions_and_gathers_full_weights(wide_model_dir: Path, batch, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    engine = ds(wide_model_dir, zero_stage=3)
    engine.train_step(batch)
    cfg = AutoConfig.from_pretrained(wide_model_dir)
    up = dict(engine.backend.module.named_parameters())["model.layers.1.mlp.up_proj.weight"]
    assert up.numel() == 0 and up.ds_numel == cfg.intermediate_size * cfg.hidden_size  # a shard, not the tensor
    weights = snapshot(engine)
    assert weights["model.embed_tokens.weight"].shape == (cfg.vocab_size, cfg.hidden_size)
    assert weights["model.layers.1.mlp.up_proj.weight"].shape == (cfg.intermediate_size, cfg.hidden_size)
    got = {n: t for b in engine.weight_buckets(1 << 18, "float32") for n, t in decode_bucket(b)}
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    engine.save_pretrained(tmp_path / "hf", tokenizer_from=wide_model_dir)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).state_dict()
    assert exported.keys() == weights.keys() and all(torch.equal(exported[k], weights[k]) for k in weights)
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("stage", [2, 3])
def test_save_load_continues_bitwise(model_for, batch, tmp_path: Path, stage: int) -> None:
    engine = ds(model_for(stage), zero_stage=stage)
    engine.train_step(batch)
    engine.save(tmp_path / "ckpt.tmp")  # the checkpoint task writes a temporary directory, then renames it
    (tmp_path / "ckpt.tmp").rename(tmp_path / "ckpt")
    files = [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
    assert (tmp_path / "ckpt" / "model.safetensors").is_file() and (tmp_path / "ckpt" / "deepspeed").is_dir()
    assert not any(str(tmp_path).encode() in p.read_bytes() for p in files)  # nothing records the old path
    m1 = engine.train_step(batch)
    w1 = snapshot(engine)
    restored = ds(model_for(stage), zero_stage=stage)
    restored.load(tmp_path / "ckpt")
    assert restored.steps_done == 1
    m2 = restored.train_step(batch)
    assert without_perf(m1) == without_perf(m2) and m1["lr"] < OPTIM.lr  # the cosine schedule resumed at step 1, not 0
    assert all(torch.equal(w1[k], v) for k, v in restored.named_weights())


def test_critic_values_match_and_update(tiny_model_dir: Path, batch) -> None:
    torch_critic = torch_engine(tiny_model_dir, role="critic")
    critic = ds(tiny_model_dir, role="critic", zero_stage=2)
    torch.manual_seed(7)  # the token-classification head has dropout and both backends run in train mode
    expected = torch_critic.values(batch)
    torch.manual_seed(7)
    values = critic.values(batch)
    assert values.shape == batch[T.RESPONSE_IDS].shape and torch.allclose(values, expected, atol=1e-5, rtol=0)
    b = batch.clone()
    b[T.VALUES], b[T.RETURNS] = values, torch.ones_like(values)
    losses = [critic.train_step(b)["vf_loss"] for _ in range(4)]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_reference_is_frozen(model_for, batch, tmp_path: Path, stage: int) -> None:
    ref = ds(model_for(stage), role="reference", zero_stage=stage)
    expected = torch_engine(model_for(stage), role="reference").logprobs(batch)["logprobs"]
    assert torch.allclose(ref.logprobs(batch)["logprobs"], expected, atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="frozen"):
        ref.train_step(batch)
    ref.save(tmp_path / "ref")
    ref.load(tmp_path / "ref")
    assert torch.allclose(ref.logprobs(batch)["logprobs"], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kw", [{"dtype": "bfloat16"}, {"bf16_autocast": True}])
def test_mixed_precision_steps(tiny_model_dir: Path, batch, kw: dict) -> None:
    engine = ds(tiny_model_dir, zero_stage=2, **kw)
    bf16_weights = next(engine.backend.module.parameters()).dtype == torch.bfloat16
    assert bf16_weights == ("dtype" in kw)  # DeepSpeed bf16 = bf16 weights + fp32 master; autocast keeps fp32
    before = snapshot(engine)
    metrics = engine.train_step(batch)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0 and metrics["logprob_diff"] < 1e-2
    assert any(not torch.equal(before[k], v) for k, v in engine.named_weights())


# ---- two data-parallel ranks on Ray -------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_on_ray_stay_in_sync(ray_session, model_for, batch, tmp_path: Path, stage: int) -> None:
    """13 rows split 6/7 over the ranks: 3 vs 4 micro-batches of 2, so the shorter rank pads (ZeRO-2 reduces in
    every backward, ZeRO-3 gathers in every forward). Then a 2-rank checkpoint resumes bitwise."""
    from transformers import AutoModelForCausalLM

    path = model_for(stage)
    spec = GroupSpec(
        name=f"ds-dp2-z{stage}",
        engine="rlstages.engines.training.core:PPOTrainer",
        kwargs={"settings": settings(path, "deepspeed", micro_batch_size=2, zero_stage=stage)},
        num_workers=2,
        env={"TORCH_EXTENSIONS_DIR": EXT_DIR, "DS_ACCELERATOR": "cpu"},
    )
    group = ActorGroup(spec, namespace="rlstages-tests")
    try:
        rows = batch[:13]
        initial = torch_engine(path).logprobs(rows)["logprobs"]
        assert torch.allclose(group.dp(600).logprobs(rows)["logprobs"], initial, atol=1e-5, rtol=0)
        per_rank = group.dp(300).train_step(rows)
        assert isinstance(per_rank, list) and len(per_rank) == 2
        assert per_rank[0]["grad_norm"] == per_rank[1]["grad_norm"] > 0  # the norm of the all-reduced gradient
        assert per_rank[0]["entropy"] != per_rank[1]["entropy"]  # each rank's own rows
        w0, w1 = group.all(120).__ray_call__(rank_weights)
        assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
        start = dict(torch_engine(path).named_weights())
        assert all(not torch.equal(w0[k], start[k]) for k in start)

        group.all(120).save(str(tmp_path / "ckpt"))
        assert len(list((tmp_path / "ckpt").rglob("zero_pp_rank_*_optim_states.pt"))) == 2
        group.all(120).save_pretrained(str(tmp_path / "hf"))  # every rank joins the gathers; rank 0 writes
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).state_dict()
        assert all(torch.equal(exported[k], w0[k]) for k in w0)
        first = group.dp(300).train_step(rows)
        after_first = group.all(120).__ray_call__(rank_weights)[0]  # collective under ZeRO-3
        group.all(120).load(str(tmp_path / "ckpt"))
        assert [without_perf(m) for m in group.dp(300).train_step(rows)] == [without_perf(m) for m in first]
        again = group.all(120).__ray_call__(rank_weights)[0]  # collective under ZeRO-3
        assert all(torch.equal(again[k], after_first[k]) for k in w0)
        check_group(group, path, rows, f"deepspeed zero{stage} dp2")  # last: one more step
    finally:
        group.kill()
