"""Multi-turn rollouts, token in / token out: a scripted engine (exact sampled ids) over a ChatML template on the
tiny char tokenizer, the real calculator and tool runner; masks, budgets, stops, bad calls, isolation and
overlap of environments, a non-prefix-preserving template, and the loss blind to masked positions.
CPU only: `pytest tests/engines/rollout/test_multi_turn.py`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch

from rlstages.configs.tools import EnvironmentSpec
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.models.tiny_tokenizer import build_char_tokenizer
from rlstages.engines.rollout.chat_render import ChatRenderer, TemplateError
from rlstages.engines.rollout.multi_turn import Budgets, MultiTurnRunner, ToolHooks
from rlstages.engines.rollout.trajectory import build_trajectory_batch, rollout_metrics, trajectory_infos
from rlstages.engines.tools import ToolResult, build_environment, parse_tool_calls, run_tool_call
from rlstages.engines.types import Prompt

# SmolLM2-135M-Instruct's ChatML template (the demo model's), as its tokenizer_config.json has it
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen3-style: an assistant turn before the last user/tool turn loses its <think> block
DROPS_THINKING = CHATML.replace(
    "message['content'] + '<|im_end|>'",
    "(message['content'].split('</think>')[-1].lstrip() if message['role'] == 'assistant' and not loop.last "
    "else message['content']) + '<|im_end|>'",
)
HOOKS = ToolHooks(parse_tool_calls, run_tool_call)
CALC = EnvironmentSpec(tools=({"name": "calculator"},))


def chatml_tokenizer(template: str = CHATML) -> Any:
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = template
    return tok


TOK = chatml_tokenizer()
EOS = TOK.convert_tokens_to_ids("<|im_end|>")


def call(expression: str, name: str = "calculator") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


class ScriptedEngine:
    """Answers each question with its scripted turns (exact ids: text + EOS, or given ids), recording what it
    was fed and the max_tokens it was given."""

    def __init__(self, script: dict[str, list[str | list[int]]]) -> None:
        self.script = script
        self.received: list[tuple[list[int], int, list[int]]] = []  # (context, limit, sampled)

    def __call__(self, contexts: list[list[int]], limits: list[int]) -> list[tuple[list[int], list[float]]]:
        out = []
        for context, limit in zip(contexts, limits, strict=True):
            text = TOK.decode(context)
            question = next(q for q in self.script if q in text)
            turn = text.count("<|im_start|>assistant") - 1
            step = self.script[question][min(turn, len(self.script[question]) - 1)]
            ids = (TOK(step, add_special_tokens=False)["input_ids"] + [EOS]) if isinstance(step, str) else list(step)
            ids = ids[:limit]
            self.received.append((list(context), limit, ids))
            out.append((ids, [-0.01 * (i + 1) for i in range(len(ids))]))
        return out


def runner(
    engine: ScriptedEngine, spec: EnvironmentSpec = CALC, tok: Any = TOK, prefill: str = "", **budgets: Any
) -> MultiTurnRunner:
    b = Budgets(**{"max_turns": 3, "max_response_tokens": 400, "per_turn_max_tokens": 120, **budgets})
    return MultiTurnRunner(ChatRenderer(tok, {EOS}), engine, lambda: build_environment(spec), HOOKS, b, {EOS}, prefill)


def prompt(q: str, uid: str = "u0") -> Prompt:
    return Prompt(uid, q, "")


def spans(batch: Any, row: int, role: str) -> list[list[int]]:
    info = trajectory_infos(batch)[row]
    ids = batch[T.RESPONSE_IDS][row].tolist()
    return [ids[s["start"] : s["end"]] for s in info["spans"] if s["role"] == role]


def test_mask_one_tokens_are_the_scripted_turns_and_mask_zero_tokens_the_tool_outputs() -> None:
    engine = ScriptedEngine({"12 * 34": [call("12*34"), "The answer is 408."]})
    trajs = runner(engine).run([prompt("What is 12 * 34?")], n=2, seed=0)
    batch = build_trajectory_batch(trajs, TOK.pad_token_id, TOK.decode)
    mask, ids = batch[T.RESPONSE_MASK], batch[T.RESPONSE_IDS]
    for row in range(2):
        policy = [TOK.decode(s) for s in spans(batch, row, "assistant")]
        assert policy == [call("12*34") + "<|im_end|>", "The answer is 408.<|im_end|>"]
        assert TOK.decode(ids[row][mask[row] == 1].tolist()) == "".join(policy)
        real = batch[T.ATTENTION_MASK][row, batch[T.PROMPT_IDS].shape[1] :].bool()
        observed = ids[row][real & (mask[row] == 0)].tolist()
        # the newline after <|im_end|> belongs to the observation (never lost, never trained on)
        assert TOK.decode(observed) == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
        assert batch[T.ROLLOUT_LOGPROBS][row][mask[row] == 0].abs().sum() == 0
    info = trajectory_infos(batch)[0]
    assert info["stop_reason"] == "done" and info["turns"] == 2
    assert info["tool_calls"][0]["name"] == "calculator" and info["tool_calls"][0]["error"] is None
    assert T.get_rows(batch, "response") == ["The answer is 408."] * 2
    assert "[obs]\n<|im_start|>tool\n408" in info["decoded"]


def test_training_ids_are_what_the_engine_received_even_when_decode_encode_changes_them() -> None:
    odd = TOK(call("7*8"), add_special_tokens=False)["input_ids"]
    odd = odd[:5] + [TOK.convert_tokens_to_ids("<s>")] + odd[5:] + [EOS]  # a special id inside the turn
    assert TOK(TOK.decode(odd, skip_special_tokens=True), add_special_tokens=False)["input_ids"] != odd[:-1]
    engine = ScriptedEngine({"7 * 8": [odd, "56"]})
    trajs = runner(engine).run([prompt("What is 7 * 8?")], n=1, seed=0)
    batch = build_trajectory_batch(trajs, TOK.pad_token_id, TOK.decode)
    last_context, _, last_sampled = engine.received[-1]
    real = batch[T.ATTENTION_MASK][0].bool()
    row = torch.cat([batch[T.PROMPT_IDS][0], batch[T.RESPONSE_IDS][0]])[real].tolist()
    assert row == last_context + last_sampled  # exactly the engine's ids, nothing re-tokenized
    assert spans(batch, 0, "assistant")[0] == odd
    assert trajectory_infos(batch)[0]["tool_calls"][0]["error"] is None  # the call still parsed from the text


def test_each_turn_gets_min_of_the_per_turn_cap_and_what_is_left() -> None:
    b = Budgets(max_response_tokens=100, per_turn_max_tokens=30, max_context_tokens=500)
    assert [b.turn_max_tokens(used, 10) for used in (0, 80, 100, 120)] == [30, 20, 0, 0]
    assert b.turn_max_tokens(0, 490) == 10  # the context window left
    engine = ScriptedEngine({"3 * 4": [call("3*4"), "12"]})
    first = len(TOK(call("3*4"), add_special_tokens=False)["input_ids"]) + 1
    trajs = runner(engine, max_response_tokens=first + 40, per_turn_max_tokens=first).run(
        [prompt("What is 3 * 4?")], 1, 0
    )
    obs = len(spans(build_trajectory_batch(trajs, 0, TOK.decode), 0, "observation")[0])
    assert [limit for _, limit, _ in engine.received] == [first, min(first, 40 - obs)]
    assert trajs[0].stop_reason == "done"


def test_a_turn_cut_at_its_limit_stops_with_length_and_the_budget_is_never_exceeded() -> None:
    engine = ScriptedEngine({"5 * 6": ["x" * 50]})
    (traj,) = runner(engine, per_turn_max_tokens=20, max_response_tokens=30).run([prompt("What is 5 * 6?")], 1, 0)
    assert traj.stop_reason == "length" and traj.response_tokens() == 20 and traj.turns == 1


def test_max_turns_stops_a_policy_that_keeps_calling() -> None:
    engine = ScriptedEngine({"2 * 2": [call("2*2")]})
    (traj,) = runner(engine, max_turns=2).run([prompt("What is 2 * 2?")], 1, 0)
    assert traj.stop_reason == "max_turns" and traj.turns == 2 and len(traj.tool_calls) == 1


def test_invalid_json_unknown_tool_and_non_object_arguments_become_masked_error_observations() -> None:
    bad = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
        + call("1+1", name="search")
        + '<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>'
    )
    engine = ScriptedEngine({"9 * 9": [bad, "81"]})
    trajs = runner(engine, per_turn_max_tokens=300, max_response_tokens=900).run([prompt("What is 9 * 9?")], 1, 0)
    batch = build_trajectory_batch(trajs, TOK.pad_token_id, TOK.decode)
    calls = trajectory_infos(batch)[0]["tool_calls"]
    assert len(calls) == 3 and all(c["error"] for c in calls)
    assert [c["parsed"] for c in calls] == [False, True, False]
    assert trajs[0].stop_reason == "done" and trajs[0].turns == 2
    (obs,) = spans(batch, 0, "observation")
    text = TOK.decode(obs)
    assert text.count("<|im_start|>tool") == 3 and "search" in text
    start = trajectory_infos(batch)[0]["spans"][1]["start"]
    assert batch[T.RESPONSE_MASK][0, start : start + len(obs)].sum() == 0
    assert rollout_metrics(batch)["tools/failure_rate"] == 1.0


PREFILL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'


def test_an_assistant_prefill_is_masked_glue_of_the_first_turn_only() -> None:
    engine = ScriptedEngine({"12 * 34": ['12*34"}}\n</tool_call>', "408"]})
    trajs = runner(engine, prefill=PREFILL).run([prompt("What is 12 * 34?")], n=1, seed=0)
    batch = build_trajectory_batch(trajs, TOK.pad_token_id, TOK.decode)
    prefill = TOK(PREFILL, add_special_tokens=False)["input_ids"]
    first_context, first_limit, first_sampled = engine.received[0]
    assert first_context[-len(prefill) :] == prefill  # the engine continued from the prefill's ids
    assert first_limit == 120  # the per-turn cap is for sampled tokens; the prefill counts in the response
    info = trajectory_infos(batch)[0]
    assert [s["role"] for s in info["spans"]] == ["prefill", "assistant", "observation", "assistant"]
    assert spans(batch, 0, "prefill") == [prefill]
    start, end = info["spans"][0]["start"], info["spans"][0]["end"]
    assert batch[T.RESPONSE_MASK][0, start:end].sum() == 0 and batch[T.ROLLOUT_LOGPROBS][0, start:end].sum() == 0
    assert spans(batch, 0, "assistant") == [first_sampled, engine.received[1][2]]
    assert batch[T.RESPONSE_MASK][0].sum() == len(first_sampled) + len(engine.received[1][2])
    # the call is parsed from the prefill and the sampled text together; it ran
    assert info["tool_calls"][0]["error"] is None
    assert json.loads(info["tool_calls"][0]["raw_arguments"]) == {"expression": "12*34"}
    # turn 2 starts at the template's generation prompt, not at the prefill: the prefill is in the row once
    second_context, _, second_sampled = engine.received[1]
    assert TOK.decode(second_context).endswith("408<|im_end|>\n<|im_start|>assistant\n")
    real = batch[T.ATTENTION_MASK][0].bool()
    row = torch.cat([batch[T.PROMPT_IDS][0], batch[T.RESPONSE_IDS][0]])[real].tolist()
    assert row == second_context + second_sampled and TOK.decode(row).count(PREFILL) == 1
    assert "[prefill]<tool_call>" in info["decoded"] and trajs[0].messages[-3]["content"].startswith(PREFILL)
    assert T.get_rows(batch, "response") == ["408"]


def test_an_assistant_prefill_is_validated() -> None:
    from pydantic import ValidationError

    from rlstages.configs.rollout import MultiTurnConfig

    with pytest.raises(ValidationError, match="assistant_prefill is only whitespace"):
        MultiTurnConfig(enabled=True, environment=CALC, assistant_prefill=" \n")
    with pytest.raises(ValueError, match="assistant_prefill .* holds an end-of-turn token"):
        runner(ScriptedEngine({}), prefill="<tool_call><|im_end|>")
    with pytest.raises(ValueError, match=r"assistant_prefill is \d+ tokens, which leaves no room"):
        runner(ScriptedEngine({}), prefill=PREFILL, max_response_tokens=len(PREFILL), per_turn_max_tokens=8)


def test_the_format_reward_scores_a_call_that_parsed_and_ran() -> None:
    from rlstages.engines.rewards.functions import tool_call_format

    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
    engine = ScriptedEngine({"3 * 3": [call("3*3"), "9"], "4 * 4": [bad, "16"], "5 * 5": ["25"]})
    questions = [prompt(f"What is {q}?", q) for q in ("3 * 3", "4 * 4", "5 * 5")]
    batch = build_trajectory_batch(runner(engine).run(questions, 1, 0), TOK.pad_token_id, TOK.decode)
    got = [tool_call_format("", "", "", extra_info={"trajectory": x}) for x in trajectory_infos(batch)]
    assert got == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="no trajectory record"):
        tool_call_format("", "", "", extra_info={})


class Counter:
    """A stateful tool: counts its own calls, sleeps, and records how many calls of all envs overlap."""

    name = "count"
    active = 0
    peak = 0

    def __init__(self) -> None:
        self.calls = 0

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "count", "parameters": {"type": "object", "properties": {}}}}

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        self.calls += 1
        Counter.active += 1
        Counter.peak = max(Counter.peak, Counter.active)
        await asyncio.sleep(0.05)
        Counter.active -= 1
        return ToolResult(text=str(self.calls))


class CountingEnv:
    def __init__(self) -> None:
        self.tool, self.row, self.closed = Counter(), None, False

    async def reset(self, row: dict[str, Any], seed: int) -> None:
        self.row = row

    def tools(self) -> list[Any]:
        return [self.tool]

    async def final_reward(self, response_text: str) -> float | None:
        return float(self.tool.calls)

    async def close(self) -> None:
        self.closed = True


def test_environments_share_no_state_and_sleeping_tools_overlap() -> None:
    envs: list[CountingEnv] = []

    def new_env() -> CountingEnv:
        envs.append(CountingEnv())
        return envs[-1]

    count = '<tool_call>{"name": "count", "arguments": {}}</tool_call>'
    engine = ScriptedEngine({"count": [count, count, "done"]})
    b = Budgets(max_turns=4, max_response_tokens=400, per_turn_max_tokens=120)
    r = MultiTurnRunner(ChatRenderer(TOK, {EOS}), engine, new_env, HOOKS, b, {EOS})
    trajs = r.run([prompt("count twice", f"u{i}") for i in range(16)], n=4, seed=0)
    assert len(envs) == 64 and all(e.closed for e in envs)
    assert [e.tool.calls for e in envs] == [2] * 64  # each env saw only its own trajectory's calls
    assert all(t.env_reward == 2.0 for t in trajs)
    assert Counter.peak > 1  # the calls of a round ran concurrently


def test_a_template_that_rewrites_history_is_refused_or_starts_new_rows() -> None:
    tok = chatml_tokenizer(DROPS_THINKING)
    assert ChatRenderer(TOK, {EOS}).prefix_preserving()
    assert not ChatRenderer(tok, {EOS}).prefix_preserving()
    engine = ScriptedEngine({"4 * 5": ["<think>\nuse it\n</think>\n" + call("4*5"), "20"]})
    with pytest.raises(TemplateError, match="template_not_prefix_preserving=new_row"):
        runner(engine, tok=tok)
    trajs = runner(engine, tok=tok, not_prefix_preserving="new_row").run([prompt("What is 4 * 5?")], 1, 0)
    batch = build_trajectory_batch(trajs, tok.pad_token_id, tok.decode)
    assert batch.batch_size[0] == 2 and T.get_rows(batch, "uid") == ["u0", "u0"]
    width = batch[T.PROMPT_IDS].shape[1]
    second_prompt = batch[T.PROMPT_IDS][1][batch[T.ATTENTION_MASK][1, :width].bool()].tolist()
    assert tok.decode(second_prompt).endswith("<|im_start|>tool\n20<|im_end|>\n<|im_start|>assistant\n")
    assert "<think>" not in tok.decode(second_prompt)  # rendered again by the template: history rewritten
    assert second_prompt == engine.received[1][0]  # the engine was fed that re-render
    assert batch[T.RESPONSE_MASK].sum(-1).tolist() == [float(len(engine.received[0][2])), 3.0]


def test_logits_at_masked_positions_change_neither_loss_nor_gradients() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=TOK.vocab_size + 8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    engine = ScriptedEngine({"6 * 7": [call("6*7"), "42"], "8 * 3": ["24"]})
    trajs = runner(engine).run([prompt("What is 6 * 7?", "a"), prompt("What is 8 * 3?", "b")], 2, 0)
    batch = build_trajectory_batch(trajs, TOK.pad_token_id, TOK.decode)
    mask = batch[T.RESPONSE_MASK]
    scores = torch.tensor([1.0, 0.0, 0.5, 0.0])
    rewards = A.outcome_to_token_rewards(scores, mask)
    adv, _ = A.compute_advantages("grpo", rewards, mask, index=T.get_rows(batch, "uid"))
    assert adv[mask == 0].abs().sum() == 0 and rewards[mask == 0].abs().sum() == 0
    last = torch.tensor([int(m.nonzero().max()) for m in mask])
    assert rewards[torch.arange(4), last].tolist() == scores.tolist()  # the outcome on the last policy token
    real = batch[T.ATTENTION_MASK][:, batch[T.PROMPT_IDS].shape[1] :].bool()
    assert (real & (mask == 0)).any()  # there are observation tokens to perturb
    params = A.PolicyLossParams(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    old, ref = batch[T.ROLLOUT_LOGPROBS], batch[T.ROLLOUT_LOGPROBS] - 0.1

    def loss_and_grads(noise: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        ids = torch.cat([batch[T.PROMPT_IDS], batch[T.RESPONSE_IDS]], 1)
        width = batch[T.RESPONSE_IDS].shape[1]
        out = model(input_ids=ids, attention_mask=batch[T.ATTENTION_MASK], position_ids=batch[T.POSITION_IDS])
        logits = out.logits[:, -width - 1 : -1]
        g = torch.Generator().manual_seed(1)
        logits = logits + noise * torch.randn(logits.shape, generator=g) * (mask == 0)[..., None]
        logp = torch.log_softmax(logits, -1).gather(-1, batch[T.RESPONSE_IDS][..., None])[..., 0]
        entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
        norm = {"global_tokens": mask.sum(), "global_seqs": torch.tensor(4.0)}
        loss, _ = A.policy_loss(old, logp, adv, mask, params, **norm, entropy=entropy, ref_logprobs=ref)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    base_loss, base_grads = loss_and_grads(0.0)
    loss, grads = loss_and_grads(50.0)
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, base_grads, strict=True))
    assert any(g.abs().sum() > 0 for g in grads)


def test_metrics_of_a_multi_turn_batch() -> None:
    engine = ScriptedEngine({"1 + 1": [call("1+1"), "2"], "2 + 2": ["4"]})
    trajs = runner(engine).run([prompt("What is 1 + 1?", "a"), prompt("What is 2 + 2?", "b")], 2, 0)
    m = rollout_metrics(build_trajectory_batch(trajs, TOK.pad_token_id, TOK.decode))
    assert m["tools/call_frequency"] == 0.5 and m["tools/failure_rate"] == 0.0
    assert m["rollout/turns_mean"] == 1.5 and m["rollout/stop_done"] == 4.0
    assert 0 < m["rollout/masked_token_fraction"] < 1 and m["tools/latency_p95_s"] >= 0
    assert json.loads(json.dumps(m)) == m
