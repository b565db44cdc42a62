"""The slot decoder (continuous batching) on a tiny random model: refilled slots decode as a one-shot batch does,
per-token versions, and the KV cache after a weight update (recomputed: the new policy's exact log-probs; kept:
detectably stale). CPU only: `pytest tests/engines/rollout/test_slots.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlstages.engines.rollout.decode import decode, picker
from rlstages.engines.rollout.fast_step import FastLlamaStep
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.rollout.slots import HFStep, RowRequest, SlotDecoder, run_rows
from tests.engines.rollout.rollout_support import assert_greedy_as_generate

TEXTS = ("1+2=", "What is 10 + 12?", "7 plus 8 is", "9-3", "How much is 4 + 4?", "5 and 6 make")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFRolloutEngine:
    return HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)


def _prompts(engine: HFRolloutEngine) -> list[list[int]]:
    return [engine.tokenizer(t)["input_ids"] for t in TEXTS]


def _step(kind: str, model: torch.nn.Module, slots: int) -> HFStep | FastLlamaStep:
    """The eager step or the fast one (static cache; 8 columns: it must make room and grow as rows join)."""
    return HFStep(model) if kind == "eager" else FastLlamaStep(model, slots, torch.float32, columns=8)


@pytest.mark.parametrize("kind", ["eager", "fast"])
def test_refilled_slots_give_the_one_shot_greedy_tokens(engine: HFRolloutEngine, kind: str) -> None:
    """Two slots for six rows, an "EOS" that some rows emit early: the freed slots take pending rows mid-decode
    (their prefill joins a cache of other widths), and every row's greedy ids and log-probs are those of all six
    decoded in one batch."""
    prompts = _prompts(engine)
    greedy = picker(1.0, 0, 1.0, True)
    enc = engine.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    free = decode(engine.model, enc["input_ids"], enc["attention_mask"], 10, set(), greedy)
    stop_id = free.ids[0][2]  # row 0 ends at its third token: a slot frees early
    one_shot = decode(engine.model, enc["input_ids"], enc["attention_mask"], 10, {stop_id}, greedy)
    decoder = SlotDecoder(2, _step(kind, engine.model, 2), {stop_id})
    admitted: list[int] = []
    original = decoder.admit
    decoder.admit = lambda reqs: (admitted.append(len(decoder.rows)), original(reqs))[1]  # type: ignore[method-assign]
    rows = run_rows(decoder, [RowRequest(i, p, 10) for i, p in enumerate(prompts)], greedy)
    assert any(live > 0 for live in admitted)  # a row joined while another was mid-decode
    for i in range(len(prompts)):
        assert rows[i].ids == one_shot.ids[i]
        assert rows[i].logprobs == pytest.approx(one_shot.logprobs[i], abs=1e-5)
        assert rows[i].versions == [0] * len(rows[i].ids)
    with pytest.raises(ValueError, match="free slots"):
        SlotDecoder(1, HFStep(engine.model), set()).admit([RowRequest(0, prompts[0], 4), RowRequest(1, prompts[1], 4)])


def test_same_admissions_same_seed_same_tokens(engine: HFRolloutEngine) -> None:
    """Sampling order is the live rows' order: the same admissions with the same seed give the same tokens."""
    prompts = _prompts(engine)

    def run(seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        rows = run_rows(
            SlotDecoder(3, HFStep(engine.model), set(engine.eos_ids)),
            [RowRequest(i, p, 8) for i, p in enumerate(prompts)],
            picker(1.0, 0, 1.0, False),
        )
        return [rows[i].ids for i in range(len(prompts))]

    assert run(4) == run(4)
    assert run(4) != run(5)


def _teacher_forced(model: torch.nn.Module, prompt: list[int], ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("kind", ["eager", "fast"])
@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_stale_kv_after_weight_update(tiny_model_dir: Path, kv: str, kind: str) -> None:
    """Issue 51's stale-KV check: rows interrupted by an in-place weight update continue; with `recompute` the
    tokens sampled after it have exactly the log-probs of a fresh prefill with the new weights; with `keep` the
    old weights' cache is detectably different, and the versions and the interruption are recorded."""
    engine = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    prompts = _prompts(engine)[:3]
    torch.manual_seed(0)
    decoder = SlotDecoder(4, _step(kind, engine.model, 4), set())
    decoder.admit([RowRequest(i, p, 12) for i, p in enumerate(prompts)])
    sample = picker(1.0, 0, 1.0, False)
    for _ in range(5):
        assert decoder.step(sample) == []
    with torch.no_grad():  # a new policy, changed in place as update_weights does
        for layer in engine.model.model.layers:
            layer.mlp.down_proj.weight.mul_(1.5)
            layer.self_attn.v_proj.weight.mul_(-1.0)
    decoder.on_weights_updated(1, kv)  # type: ignore[arg-type]
    rows = decoder.drain(sample)
    assert len(rows) == 3
    for row in rows:
        assert row.versions == [0] * 5 + [1] * 7
        assert (row.interrupted, row.kv_kept) == (1, int(kv == "keep"))
    gaps = []
    for row in rows:
        fresh = _teacher_forced(engine.model, row.prompt_ids, row.ids)
        gaps.extend(abs(a - b) for a, b in zip(fresh[5:], row.logprobs[5:], strict=True))
    if kv == "recompute":
        assert max(gaps) < 1e-4
    else:
        assert max(gaps) > 1e-2  # the cache of the old weights shows


def test_fast_step_greedy_equals_model_generate(engine: HFRolloutEngine) -> None:
    """The engine's default step on CPU (the fast one) decodes greedily what transformers' `generate` does."""
    from rlstages.engines.types import Prompt, SamplingParams

    assert engine._fast_step(2, 64) is not None  # the tiny qwen2 takes the fast step
    prompts = [Prompt(f"u{i}", text, "0") for i, text in enumerate(TEXTS)]
    batch = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=10), seed=0)
    assert_greedy_as_generate(engine, TEXTS, batch)


@pytest.mark.parametrize("head", ["", "You are a calculator. Answer the question: "])
def test_the_fast_steps_prefill_in_parts_decodes_as_in_one(engine: HFRolloutEngine, head: str, monkeypatch) -> None:
    """Rows of six prompts (two each, of other lengths; with and without a prefix all share) prefilled two
    distinct prompts at a time (`fast_step.PREFILL_PROMPTS`, which bounds the prefill's transient cache) decode
    greedily what one prefill of all of them decodes."""
    from rlstages.engines.rollout import fast_step

    prompts = [engine.tokenizer(head + t)["input_ids"] for t in TEXTS]
    requests = [RowRequest(i, prompts[i // 2], 8) for i in range(12)]
    greedy = picker(1.0, 0, 1.0, True)
    runs, original = {}, fast_step.prefill_distinct
    for limit in (64, 2):
        monkeypatch.setattr(fast_step, "PREFILL_PROMPTS", limit)
        parts: list[int] = []

        def counted(m: torch.nn.Module, i: torch.Tensor, a: torch.Tensor, heads=None, parts=parts) -> object:
            parts.append(len(i))
            return original(m, i, a, heads)

        monkeypatch.setattr(fast_step, "prefill_distinct", counted)
        runs[limit] = run_rows(SlotDecoder(12, _step("fast", engine.model, 12), set()), requests, greedy)
        assert parts == ([12] if limit == 64 else [4, 4, 4])
    for i in range(12):
        assert runs[2][i].ids == runs[64][i].ids
        assert runs[2][i].logprobs == pytest.approx(runs[64][i].logprobs, abs=1e-5)


def test_the_fast_step_computes_in_inference_mode_and_keeps_its_buffers_normal(
    engine: HFRolloutEngine, monkeypatch
) -> None:
    """The fast step's prefill and decode run under `torch.inference_mode` (no autograd bookkeeping on their small
    ops), while its cache buffers, grown and moved as rows join and leave, stay normal tensors: a streaming
    decoder updates them in place outside that mode (a weight update's rewind, a row's departure)."""
    from rlstages.engines.rollout import fast_step

    modes: list[bool] = []
    original = fast_step.prefill_distinct

    def spy(m: torch.nn.Module, i: torch.Tensor, a: torch.Tensor, heads=None) -> object:
        modes.append(torch.is_inference_mode_enabled())
        return original(m, i, a, heads)

    monkeypatch.setattr(fast_step, "prefill_distinct", spy)
    step = FastLlamaStep(engine.model, 4, torch.float32, columns=4)  # too narrow: the first prefill grows it
    prompts = _prompts(engine)
    first = step.prefill(prompts[:2])
    assert modes == [True]
    for _ in range(3):
        logits = step.forward(first.argmax(-1))
        assert logits.is_inference() and not torch.is_inference_mode_enabled()
    step.prefill(prompts[2:4])  # joins the live rows: columns shifted, buffers wider
    assert step.columns > 4
    buffers = (*step.keys, *step.values, step.valid, step.position)
    assert not any(t.is_inference() for t in buffers)
    step.rewind()  # in place, outside inference mode: an inference tensor here would raise
    step.select([0, 2, 3])
    assert step.n == 3 and not step.valid[:3, step.column].any()
    assert torch.isfinite(step.forward(torch.tensor([1, 2, 3]))).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fast_steps_rotation_is_the_models_bit_for_bit(dtype: torch.dtype) -> None:
    """The decode step's four-op rotation (`_rotate_rolled` over `_signed_sin`) is `_rotate`, transformers'
    rotate_half form, bit for bit: a sign moves from one factor to the other."""
    from rlstages.engines.rollout.fast_step import _rotate, _rotate_rolled, _signed_sin

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(16, 12, 64, generator=gen) * 3).to(dtype)
    angles = torch.rand(16, 1, 64, generator=gen) * 40
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert torch.equal(_rotate_rolled(x, cos, _signed_sin(sin)), _rotate(x, cos, sin))


def test_only_a_call_scoped_step_decodes_in_inference_mode(engine: HFRolloutEngine, monkeypatch) -> None:
    """A generate call runs its slot loop under inference mode for the eager and fast steps, not for the compiled
    step, whose kernel outlives the call (`DecodeStep.CALL_SCOPED`)."""
    from rlstages.engines.rollout import hf_rollout
    from rlstages.engines.rollout.compiled_step import CompiledLlamaStep
    from rlstages.engines.types import Prompt, SamplingParams

    assert HFStep.CALL_SCOPED and FastLlamaStep.CALL_SCOPED and not CompiledLlamaStep.CALL_SCOPED
    seen: list[bool] = []
    original = hf_rollout.run_rows

    def spy(*args: object) -> object:
        seen.append(torch.is_inference_mode_enabled())
        return original(*args)

    def kept(slots: int, columns: int) -> FastLlamaStep:  # a step whose tensors outlive the call, as the compiled
        step = FastLlamaStep(engine.model, slots, torch.float32, columns)
        step.CALL_SCOPED = False
        return step

    monkeypatch.setattr(hf_rollout, "run_rows", spy)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=2)
    for fast in (lambda slots, columns: None, kept):  # the eager transformers step, then one not call-scoped
        monkeypatch.setattr(engine, "_fast_step", fast)
        engine.generate([Prompt("p0", TEXTS[0], "3")], greedy, seed=0)
    assert seen == [True, False]


def test_an_unsupported_model_falls_back_with_one_line(engine: HFRolloutEngine, caplog) -> None:
    from rlstages.engines.rollout.fast_step import fast_step

    engine.model.config.hidden_act = "gelu"
    try:
        with caplog.at_level("WARNING"):
            assert fast_step(engine.model, 2, torch.float32) is None
    finally:
        engine.model.config.hidden_act = "silu"
    assert [r.getMessage() for r in caplog.records if "fast decode step is off" in r.getMessage()] == [
        "rollout: the fast decode step is off (hidden_act 'gelu' (silu expected)); decoding with the eager "
        "transformers step"
    ]


def test_fp32_rollout_weights_of_a_bf16_model(tiny_model_dir: Path) -> None:
    """A bf16 model decoded on its fp32 copy: the log-probs are those of the fp32 model (the bf16 values
    widened) and the model's own parameters stay bf16 and untouched."""
    from rlstages.engines.models import load_causal_lm
    from rlstages.engines.types import Prompt, SamplingParams

    engine = HFRolloutEngine(tiny_model_dir, dtype="bfloat16", apply_chat_template=False, fp32_weights=True)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    batch = engine.generate([Prompt("u", TEXTS[1], "0")], SamplingParams(n=3, max_new_tokens=8), seed=1)
    assert all(torch.equal(v, engine.model.state_dict()[k]) and v.dtype == torch.bfloat16 for k, v in before.items())
    wide = load_causal_lm(tiny_model_dir, "bfloat16").float()
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    with torch.no_grad():
        logits = wide(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits
    p = batch["prompt_ids"].shape[1]
    lp = torch.log_softmax(logits[:, p - 1 : -1].float(), -1).gather(-1, batch["response_ids"][..., None])[..., 0]
    assert ((lp - batch["rollout_logprobs"]).abs() * batch["response_mask"]).max() < 1e-4
