"""The compiled decode step (`rollout.decode_step: compiled`, `engines/rollout/compiled_step.py`) on a tiny
random Qwen2: greedy equals transformers' `generate`, its fused sampling's log-probs equal a recompute, a weight
update reuses the compiled code, and where it cannot be built the fast step decodes with one line. CPU only
(inductor's C++ code: g++ on PATH): `pytest tests/engines/rollout/test_compiled_step.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlstages.engines.rollout.compiled_step import CompiledLlamaStep
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.types import Prompt, SamplingParams
from tests.engines.rollout.rollout_support import assert_greedy_as_generate

TEXTS = ("1+2=", "What is 10 + 12?", "7 plus 8 is", "9-3", "How much is 4 + 4?", "5 and 6 make")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFRolloutEngine:
    torch._dynamo.reset()
    return HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False, decode_step="compiled")


def _prompts() -> list[Prompt]:
    return [Prompt(f"u{i}", text, "0") for i, text in enumerate(TEXTS)]


def _recompute(model: torch.nn.Module, batch) -> torch.Tensor:
    """The trainer's teacher-forced log-probs of the sampled tokens (tempered as the rollout samples)."""
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits
    p = batch["prompt_ids"].shape[1]
    tempered = logits[:, p - 1 : -1].float() / 0.7
    return torch.log_softmax(tempered, -1).gather(-1, batch["response_ids"][..., None])[..., 0]


def test_compiled_greedy_equals_model_generate(engine: HFRolloutEngine) -> None:
    """Two slots for six rows (freed slots refilled mid-decode): every row's greedy ids are `generate`'s."""
    engine.batch_size = 2
    try:
        assert isinstance(engine._fast_step(2, 64), CompiledLlamaStep)
        batch = engine.generate(_prompts(), SamplingParams(n=1, temperature=0.0, max_new_tokens=10), seed=0)
    finally:
        engine.batch_size = 64
    assert engine.compiled.off is None and engine.compiled.fn is not None  # it ran compiled, no fallback
    assert_greedy_as_generate(engine, TEXTS, batch)


def test_sampled_logprobs_equal_the_trainers_and_updates_do_not_recompile(engine: HFRolloutEngine) -> None:
    """Sampled inside the compiled step (T=0.7): the behaviour log-probs equal a teacher-forced recompute; after
    an in-place weight update the next generation follows the new weights with no new compilation."""
    sampling = SamplingParams(n=4, temperature=0.7, max_new_tokens=12)
    batch = engine.generate(_prompts()[:3], sampling, seed=3)
    gap = ((_recompute(engine.model, batch) - batch["rollout_logprobs"]).abs() * batch["response_mask"]).max()
    assert gap < 1e-4
    torch._dynamo.utils.counters.clear()
    new = {n: p.detach() * 1.5 + 0.01 for n, p in engine.model.named_parameters()}
    engine.update_weights(iter(new.items()))
    after = engine.generate(_prompts()[:3], sampling, seed=3)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # no new graph compiled for new weights
    assert not torch.equal(after["response_ids"], batch["response_ids"])
    gap = ((_recompute(engine.model, after) - after["rollout_logprobs"]).abs() * after["response_mask"]).max()
    assert gap < 1e-4  # the log-probs are the updated model's


def test_an_unsupported_model_falls_back_with_one_line(tiny_model_dir: Path, caplog) -> None:
    """An architecture the step does not know: one line for any number of generations, the eager step decodes."""
    engine = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False, decode_step="compiled")
    engine.model.config.hidden_act = "gelu"
    with caplog.at_level("WARNING"):
        for _ in range(2):
            engine.generate(_prompts()[:1], SamplingParams(n=1, max_new_tokens=2), seed=0)
    assert [r.getMessage() for r in caplog.records if "decode step is off" in r.getMessage()] == [
        "rollout: the fast decode step is off (hidden_act 'gelu' (silu expected)); decoding with the eager "
        "transformers step"
    ]


def test_a_compile_failure_falls_back_to_the_fast_step_with_one_line(tiny_model_dir: Path, caplog) -> None:
    """No usable compiler (a backend that fails): the fast eager step decodes the same greedy tokens, said once."""
    engine = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False, decode_step="compiled")
    fast = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False, decode_step="fast")

    def broken(*args: object) -> None:
        raise RuntimeError("no compiler")

    engine.compiled.fn = broken
    sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    with caplog.at_level("WARNING"):
        got = [engine.generate(_prompts(), sampling, seed=0)["response_ids"] for _ in range(2)]
    assert torch.equal(got[0], fast.generate(_prompts(), sampling, seed=0)["response_ids"])
    assert [r.getMessage() for r in caplog.records if "decode step is off" in r.getMessage()] == [
        "rollout: the compiled decode step is off (RuntimeError: no compiler); decoding with the fast eager step"
    ]
