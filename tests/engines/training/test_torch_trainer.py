"""The PPO trainer on the torch backend: log-probs, GRPO update, gradient accumulation exactness, dynamic
batching, critic, frozen reference, LR schedule and its horizon, and save/load that continues bitwise. CPU only."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlstages.configs.training import OptimConfig, TorchTrainingConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.training.core import PPOTrainer, without_perf
from rlstages.engines.training.optim import lr_lambda
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.types import Prompt, SamplingParams

PROMPTS = [Prompt(f"u{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]


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


def trainer(path: Path, role="actor", loss=A.PolicyLossParams(), num_mini_batches: int = 1, **train) -> PPOTrainer:
    train.setdefault("micro_batch_size", 4)
    options = TorchTrainingConfig(optim=OptimConfig(lr=1e-2, total_steps=10), **train)
    return PPOTrainer(
        TrainerSettings(str(path), role=role, train=options, loss=loss, num_mini_batches=num_mini_batches)
    )


def snapshot(engine: PPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.named_weights()}


def test_logprobs_agree_with_rollout(tiny_model_dir: Path, batch) -> None:
    out = trainer(tiny_model_dir).logprobs(batch)
    diff = (out["logprobs"] - batch[T.ROLLOUT_LOGPROBS]).abs() * batch[T.RESPONSE_MASK]
    assert diff.max() < 1e-4 and out["entropy"].shape == batch[T.RESPONSE_IDS].shape


def test_grpo_step_moves_parameters_and_reports(tiny_model_dir: Path, batch) -> None:
    engine = trainer(tiny_model_dir)
    before = snapshot(engine)
    metrics = engine.train_step(batch)
    after = dict(engine.named_weights())
    assert sum(not torch.equal(before[k], after[k]) for k in before) == len(before)
    for key in ("pg_loss", "pg_clipfrac", "entropy", "grad_norm", "lr", "logprob_diff"):
        assert key in metrics and math.isfinite(metrics[key])
    assert metrics["grad_norm"] > 0 and metrics["logprob_diff"] < 1e-4


def test_accumulation_equals_one_big_batch(tiny_model_dir: Path, batch) -> None:
    small = trainer(tiny_model_dir, micro_batch_size=2)
    big = trainer(tiny_model_dir, micro_batch_size=16)
    m_small, m_big = small.train_step(batch), big.train_step(batch)
    assert m_small["grad_norm"] == pytest.approx(m_big["grad_norm"], rel=1e-4)
    assert m_small["pg_loss"] == pytest.approx(m_big["pg_loss"], abs=1e-6)
    small_opt, big_opt = small.backend.optimizer, big.backend.optimizer
    assert small_opt is not None and big_opt is not None
    for p_small, p_big in zip(small.backend.model.parameters(), big.backend.model.parameters(), strict=True):
        grad_small = small_opt.state[p_small]["exp_avg"]  # (1 - beta1) x the accumulated gradient
        grad_big = big_opt.state[p_big]["exp_avg"]
        assert torch.allclose(grad_small, grad_big, atol=1e-7, rtol=1e-4)


def varied_lengths(batch):
    """The batch with row i's response cut to at most 1 + (5 * i) % 8 tokens (its rollout log-probs stay valid for the
    prefix): lengths interleave, so sorting reorders rows and changes the padding."""
    from rlstages.engines.rollout.batching import build_rollout_batch

    lengths = batch[T.RESPONSE_MASK].sum(-1).long().tolist()  # a row may have ended early (EOS)
    keep = [min(1 + (5 * i) % 8, lengths[i]) for i in range(batch.batch_size[0])]
    responses = [batch[T.RESPONSE_IDS][i, :k].tolist() for i, k in enumerate(keep)]
    logprobs = [batch[T.ROLLOUT_LOGPROBS][i, :k].tolist() for i, k in enumerate(keep)]
    n = 4
    prompts = PROMPTS[: batch.batch_size[0] // n]
    prompt_ids = [
        batch[T.PROMPT_IDS][i * n][batch[T.ATTENTION_MASK][i * n, : batch[T.PROMPT_IDS].shape[1]] > 0].tolist()
        for i in range(len(prompts))
    ]
    return build_rollout_batch(prompts, prompt_ids, responses, logprobs, ["" for _ in keep], n, pad_id=0)


def test_length_sorted_micro_batches_pad_less_and_restore_order(tiny_model_dir: Path, batch) -> None:
    from rlstages.engines.training.microbatch import by_length, micro_batches

    varied = varied_lengths(batch)
    rows, restore = by_length(varied)
    lengths = rows[T.ATTENTION_MASK].sum(-1)
    assert bool((lengths[1:] >= lengths[:-1]).all())
    assert not torch.equal(rows[T.RESPONSE_IDS], varied[T.RESPONSE_IDS])  # the sort really moved rows
    assert torch.equal(rows[restore][T.RESPONSE_IDS], varied[T.RESPONSE_IDS])

    def padded(b) -> int:
        return sum(mb[T.ATTENTION_MASK].numel() for mb in micro_batches(b, 4))

    assert padded(rows) < padded(varied)
    out = trainer(tiny_model_dir).logprobs(varied)  # computed on sorted micro-batches, returned in row order
    diff = (out["logprobs"] - varied[T.ROLLOUT_LOGPROBS]).abs() * varied[T.RESPONSE_MASK]
    assert diff.max() < 1e-4


def test_dynamic_batching_same_update(tiny_model_dir: Path, batch) -> None:
    dyn = trainer(tiny_model_dir, micro_batch_size=16, dynamic_batching=True, max_tokens_per_micro_batch=64)
    fixed = trainer(tiny_model_dir, micro_batch_size=16)
    assert dyn.train_step(batch)["grad_norm"] == pytest.approx(fixed.train_step(batch)["grad_norm"], rel=1e-4)


def test_mini_batches_and_epochs_take_several_optimizer_steps(tiny_model_dir: Path, batch) -> None:
    engine = trainer(tiny_model_dir, num_mini_batches=2, ppo_epochs=2)
    old = engine.logprobs(batch)["logprobs"]
    b = batch.clone()
    b[T.OLD_LOGPROBS] = old
    metrics = engine.train_step(b)
    assert engine.backend.scheduler is not None and engine.backend.scheduler.last_epoch == 4
    assert metrics["ppo_kl"] != 0.0  # later mini-batches see a moved policy


def test_save_load_continues_bitwise(tiny_model_dir: Path, batch, tmp_path: Path) -> None:
    engine = trainer(tiny_model_dir)
    engine.train_step(batch)
    engine.save(tmp_path / "ckpt")
    assert not list((tmp_path / "ckpt").glob("*.pt")) and (tmp_path / "ckpt" / "model.safetensors").is_file()
    m1 = engine.train_step(batch)
    w1 = snapshot(engine)
    restored = trainer(tiny_model_dir)
    restored.load(tmp_path / "ckpt")
    m2 = restored.train_step(batch)
    assert without_perf(m1) == without_perf(m2)
    assert all(torch.equal(w1[k], v) for k, v in restored.named_weights())


def test_tied_weights_saved_once_and_restored(tmp_path: Path, batch) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from rlstages.engines.models import build_tiny_model

    tied_dir = build_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    engine = trainer(tied_dir)
    engine.train_step(batch)
    engine.save(tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys  # the tied matrix once
    m1 = engine.train_step(batch)
    restored = trainer(tied_dir)
    restored.load(tmp_path / "ckpt")
    model = restored.backend.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after the load
    assert without_perf(restored.train_step(batch)) == without_perf(m1)
    weights = load_file(str(file))
    del weights["model.norm.weight"]  # a tensor that is nobody's alias: its absence is refused
    save_file(weights, str(file))
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        trainer(tied_dir).load(tmp_path / "ckpt")


def test_critic_values_and_update(tiny_model_dir: Path, batch) -> None:
    critic = trainer(tiny_model_dir, role="critic")
    values = critic.values(batch)
    assert values.shape == batch[T.RESPONSE_IDS].shape
    b = batch.clone()
    b[T.VALUES] = values
    b[T.RETURNS] = torch.ones_like(values)
    first = critic.train_step(b)["vf_loss"]
    for _ in range(5):
        last = critic.train_step(b)["vf_loss"]
    assert last < first


def test_reference_is_frozen(tiny_model_dir: Path, batch) -> None:
    ref = trainer(tiny_model_dir, role="reference")
    assert not any(p.requires_grad for p in ref.backend.model.parameters())
    with pytest.raises(RuntimeError, match="frozen"):
        ref.train_step(batch)


def test_kl_loss_and_entropy_terms(tiny_model_dir: Path, batch) -> None:
    loss = A.PolicyLossParams(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
    engine = trainer(tiny_model_dir, loss=loss)
    b = batch.clone()
    b[T.REF_LOGPROBS] = batch[T.ROLLOUT_LOGPROBS] - 0.5
    metrics = engine.train_step(b)
    assert metrics["kl_loss"] > 0 and metrics["entropy"] > 0


def test_lr_schedule_horizon_counts_optimizer_steps() -> None:
    """The schedule spans trainer steps x PPO epochs x mini-batches optimizer steps (derived in one place)."""
    train = TorchTrainingConfig(ppo_epochs=2)
    settings = TrainerSettings("m", train=train, num_mini_batches=3, train_steps=5)
    assert settings.optim_steps == 30
    fixed = TorchTrainingConfig(ppo_epochs=2, optim=OptimConfig(total_steps=4))
    assert TrainerSettings("m", train=fixed, num_mini_batches=3, train_steps=5).optim_steps == 24
    assert settings.optim_record()["total_steps"] == 30


def test_lr_schedule_warmup_then_cosine() -> None:
    f = lr_lambda(OptimConfig(warmup_steps=2, schedule="cosine", min_lr_ratio=0.1), 10)
    assert [round(f(s), 3) for s in (0, 1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0) and f(10) == pytest.approx(0.1) and f(6) == pytest.approx(0.55)


def test_lr_schedule_holds_its_peak_until_the_last_decay_steps() -> None:
    """Warm-up, stable, decay: the LR of a run with `decay_steps` is the constant schedule's until the decay's
    first step, then the cosine down to `min_lr_ratio` at the horizon."""
    f = lr_lambda(OptimConfig(warmup_steps=2, schedule="cosine", min_lr_ratio=0.1, decay_steps=4), 10)
    flat = lr_lambda(OptimConfig(warmup_steps=2), 10)
    assert [f(s) for s in range(7)] == [flat(s) for s in range(7)]
    assert f(8) == pytest.approx(0.55) and f(10) == pytest.approx(0.1) and f(7) < 1.0
    longer = lr_lambda(OptimConfig(warmup_steps=2, schedule="cosine", min_lr_ratio=0.1, decay_steps=50), 10)
    assert longer(6) == pytest.approx(0.55)  # a decay longer than the run starts after the warm-up


def grouped_batch(batch):
    """`varied_lengths` with prompts of different lengths too (prompt i loses its first i % 3 tokens, so left
    padding differs between groups) and GRPO advantages."""
    from rlstages.engines.rollout.batching import build_rollout_batch

    varied = varied_lengths(batch)
    n, width = 4, varied[T.PROMPT_IDS].shape[1]
    prompt_ids = [
        varied[T.PROMPT_IDS][i * n][varied[T.ATTENTION_MASK][i * n, :width] > 0].tolist()[i % 3 :]
        for i in range(varied.batch_size[0] // n)
    ]
    mask = varied[T.RESPONSE_MASK]
    responses = [varied[T.RESPONSE_IDS][i, : int(mask[i].sum())].tolist() for i in range(len(mask))]
    out = build_rollout_batch(PROMPTS, prompt_ids, responses, [[0.0] * len(r) for r in responses], [""] * 16, n, 0)
    token = A.outcome_to_token_rewards((torch.arange(16) % 3 == 0).float(), out[T.RESPONSE_MASK])
    out[T.ADVANTAGES], _ = A.compute_advantages("grpo", token, out[T.RESPONSE_MASK], T.get_rows(out, "uid"))
    return out


def test_shared_prompt_forward_gives_the_same_logprobs_and_update(tiny_model_dir: Path, batch) -> None:
    from rlstages.engines.training.microbatch import by_length, micro_batches

    grouped = grouped_batch(batch)
    assert len(set(grouped[T.ATTENTION_MASK][:, : grouped[T.PROMPT_IDS].shape[1]].sum(-1).tolist())) > 1
    distinct = [len(set(T.get_rows(mb, "uid"))) for mb in micro_batches(by_length(grouped)[0], 8)]
    assert 1 < max(distinct) < 8  # micro-batches where some rows share a prompt and several prompts meet
    shared = trainer(tiny_model_dir, micro_batch_size=8, share_prompt_forward=True)
    plain = trainer(tiny_model_dir, micro_batch_size=8)
    lp_shared, lp_plain = shared.logprobs(grouped), plain.logprobs(grouped)
    mask = grouped[T.RESPONSE_MASK]
    assert ((lp_shared["logprobs"] - lp_plain["logprobs"]).abs() * mask).max() < 1e-5
    assert ((lp_shared["entropy"] - lp_plain["entropy"]).abs() * mask).max() < 1e-4
    m_shared, m_plain = shared.train_step(grouped), plain.train_step(grouped)
    assert m_shared["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=1e-4)
    opt_shared, opt_plain = shared.backend.optimizer, plain.backend.optimizer
    assert opt_shared is not None and opt_plain is not None
    for p_shared, p_plain in zip(shared.backend.model.parameters(), plain.backend.model.parameters(), strict=True):
        grad_shared = opt_shared.state[p_shared]["exp_avg"]  # (1 - beta1) x the accumulated gradient
        assert grad_shared.abs().max() > 0
        assert torch.allclose(grad_shared, opt_plain.state[p_plain]["exp_avg"], atol=1e-7, rtol=1e-4)


def test_shared_prompts_budget_micro_batches_by_their_responses(tiny_model_dir: Path, batch) -> None:
    """With each prompt through the model once, a row costs its response: fewer, fuller micro-batches within
    the same token budget, and the same update."""
    from rlstages.engines.training.microbatch import by_length, micro_batches

    grouped, budget = grouped_batch(batch), 24
    rows = by_length(grouped, prompt_once=True)[0]
    responses = rows[T.ATTENTION_MASK][:, rows[T.PROMPT_IDS].shape[1] :].sum(-1)
    assert bool((responses[1:] >= responses[:-1]).all())
    once = micro_batches(rows, 16, dynamic=True, max_tokens=budget, prompt_once=True)
    whole = micro_batches(rows, 16, dynamic=True, max_tokens=budget)
    assert len(once) < len(whole)
    assert all(mb.batch_size[0] * mb[T.RESPONSE_IDS].shape[1] <= budget for mb in once)
    assert sum(mb.batch_size[0] for mb in once) == grouped.batch_size[0]
    dynamic = {"dynamic_batching": True, "max_tokens_per_micro_batch": budget}
    shared = trainer(tiny_model_dir, micro_batch_size=16, share_prompt_forward=True, **dynamic)
    plain = trainer(tiny_model_dir, micro_batch_size=16)
    assert shared.train_step(grouped)["grad_norm"] == pytest.approx(plain.train_step(grouped)["grad_norm"], rel=1e-4)


def test_shared_prompt_forward_refuses_gradient_checkpointing() -> None:
    with pytest.raises(ValueError, match="share_prompt_forward needs the KV cache"):
        TorchTrainingConfig(share_prompt_forward=True, gradient_checkpointing=True)


def test_the_cache_is_released_only_where_another_engine_shares_the_gpu(
    tiny_model_dir: Path, batch, monkeypatch
) -> None:
    """`empty_cache` after each forward and update only with `shares_device` (colocated, hybrid); a trainer alone
    on its GPU keeps its cached blocks. The update is the same either way."""
    from rlstages.engines.runtime import device as D

    released: list[torch.device] = []
    monkeypatch.setattr(D, "free_cached", released.append)
    alone = trainer(tiny_model_dir)
    assert not alone.shares_device
    alone.logprobs(batch)
    alone_metrics = without_perf(alone.train_step(batch))
    assert released == []
    options = TorchTrainingConfig(optim=OptimConfig(lr=1e-2, total_steps=10), micro_batch_size=4)
    shared = PPOTrainer(TrainerSettings(str(tiny_model_dir), train=options, shares_device=True))
    shared.logprobs(batch)
    assert without_perf(shared.train_step(batch)) == alone_metrics
    assert len(released) == 2  # after the forward, after the update


def test_metrics_kept_on_the_device_read_once_per_optimizer_step(tiny_model_dir: Path, batch, monkeypatch) -> None:
    """On a GPU the micro-batches' metrics stay device tensors, added there, and are read in one transfer per
    optimizer step (`ppo_step.floats`), not one `.item()` each per micro-batch: forced here on CPU tensors, the
    step's metrics equal the per-micro-batch float path's (4 micro-batches, 2 optimizer steps)."""
    from rlstages.engines.training import ppo_step as P

    loss = A.PolicyLossParams(entropy_coeff=0.01)
    floats_path = without_perf(
        trainer(tiny_model_dir, loss=loss, num_mini_batches=2, micro_batch_size=2).train_step(batch)
    )
    as_tensor = lambda v: torch.as_tensor(v).detach().reshape(()).to(torch.float64)  # noqa: E731  # a GPU's scalar()
    reads: list[int] = []
    floats = P.floats

    def counted(acc):
        assert acc and all(isinstance(v, torch.Tensor) for k, v in acc.items() if k != "kl_coef")
        reads.append(len(acc))
        return floats(acc)

    monkeypatch.setattr(P, "scalar", as_tensor)
    monkeypatch.setattr(P, "floats", counted)
    tensor_path = without_perf(
        trainer(tiny_model_dir, loss=loss, num_mini_batches=2, micro_batch_size=2).train_step(batch)
    )
    assert len(reads) == 2  # one read per optimizer step
    assert tensor_path.keys() == floats_path.keys()
    for key, value in floats_path.items():
        assert tensor_path[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
