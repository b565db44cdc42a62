"""HF rollout engine on a tiny random model: the batch contract, log-probs vs a teacher-forced recompute,
seeding, greedy, stop strings, weight updates and sleep/wake. CPU only:
`pytest tests/engines/rollout/test_hf_rollout.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlstages.engines import types as T
from rlstages.engines.models import load_causal_lm
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.types import Prompt, SamplingParams

PROMPTS = [Prompt(f"u{i}", f"What is {i} + {i + 1}?", str(2 * i + 1)) for i in range(3)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFRolloutEngine:
    return HFRolloutEngine(tiny_model_dir, dtype="float32", batch_size=5, apply_chat_template=False)


def recompute(model_dir: Path, batch) -> torch.Tensor:
    model = load_causal_lm(model_dir)
    ids = torch.cat([batch[T.PROMPT_IDS], batch[T.RESPONSE_IDS]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=batch[T.ATTENTION_MASK], position_ids=batch[T.POSITION_IDS]).logits
    p, t = batch[T.PROMPT_IDS].shape[1], batch[T.RESPONSE_IDS].shape[1]
    return torch.log_softmax(logits[:, p - 1 : p + t - 1].float(), -1).gather(-1, batch[T.RESPONSE_IDS][..., None])[
        ..., 0
    ]


def test_contract_shapes_masks_and_groups(engine: HFRolloutEngine) -> None:
    batch = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=12), seed=3)
    assert batch.batch_size[0] == 12
    assert T.get_rows(batch, "uid") == [p.uid for p in PROMPTS for _ in range(4)]
    assert T.get_rows(batch, "ground_truth")[4] == PROMPTS[1].ground_truth
    pids, rids, mask = batch[T.PROMPT_IDS], batch[T.RESPONSE_IDS], batch[T.RESPONSE_MASK]
    assert batch[T.ATTENTION_MASK].shape == (12, pids.shape[1] + rids.shape[1])
    assert (batch[T.ATTENTION_MASK][:, pids.shape[1] :] == mask.long()).all()
    lengths = mask.sum(-1).long()
    for row in range(12):  # right padding: ones then zeros; padding holds the pad id
        n = int(lengths[row])
        assert mask[row, :n].all() and not mask[row, n:].any()
        assert (rids[row, n:] == engine.pad_id).all()
    first = batch[T.ATTENTION_MASK][:, : pids.shape[1]]  # left padding: zeros then ones
    assert (first.cummax(-1).values == first).all()
    assert (batch[T.ROLLOUT_LOGPROBS] <= 0).all() and (batch[T.ROLLOUT_LOGPROBS][mask == 0] == 0).all()


def test_logprobs_match_teacher_forced_recompute(engine: HFRolloutEngine, tiny_model_dir: Path) -> None:
    batch = engine.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=10), seed=1)
    diff = (recompute(tiny_model_dir, batch) - batch[T.ROLLOUT_LOGPROBS]).abs() * batch[T.RESPONSE_MASK]
    assert diff.max() < 1e-4


def test_temperature_and_top_k_logprobs(engine: HFRolloutEngine, tiny_model_dir: Path) -> None:
    batch = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.5, top_k=5, max_new_tokens=6), seed=2)
    model = load_causal_lm(tiny_model_dir)
    ids = torch.cat([batch[T.PROMPT_IDS], batch[T.RESPONSE_IDS]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=batch[T.ATTENTION_MASK], position_ids=batch[T.POSITION_IDS]).logits
    p, t = batch[T.PROMPT_IDS].shape[1], batch[T.RESPONSE_IDS].shape[1]
    step_logits = logits[:, p - 1 : p + t - 1].float()
    expected = torch.log_softmax(step_logits / 0.5, -1).gather(-1, batch[T.RESPONSE_IDS][..., None])[..., 0]
    mask = batch[T.RESPONSE_MASK]
    assert ((expected - batch[T.ROLLOUT_LOGPROBS]).abs() * mask).max() < 1e-4
    rank = (step_logits > step_logits.gather(-1, batch[T.RESPONSE_IDS][..., None])).sum(-1)
    assert (rank[mask.bool()] < 5).all()  # every sampled token is in the top 5


def test_seeded_and_greedy(engine: HFRolloutEngine) -> None:
    params = SamplingParams(n=2, max_new_tokens=8)
    a, b = engine.generate(PROMPTS, params, seed=7), engine.generate(PROMPTS, params, seed=7)
    c = engine.generate(PROMPTS, params, seed=8)
    assert torch.equal(a[T.RESPONSE_IDS], b[T.RESPONSE_IDS])
    assert not torch.equal(a[T.RESPONSE_IDS], c[T.RESPONSE_IDS])
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)
    g1, g2 = engine.generate(PROMPTS, greedy, seed=1), engine.generate(PROMPTS, greedy, seed=99)
    assert torch.equal(g1[T.RESPONSE_IDS], g2[T.RESPONSE_IDS])
    assert torch.equal(g1[T.RESPONSE_IDS][0], g1[T.RESPONSE_IDS][1])


def test_stop_strings_cut_the_response(engine: HFRolloutEngine) -> None:
    free = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=16), seed=5)
    texts = T.get_rows(free, "response")
    stop = next(ch for text in texts for ch in text[1:] if ch.strip())  # a char that occurs mid-response
    cut = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=16, stop=(stop,)), seed=5)
    for before, after, n in zip(texts, T.get_rows(cut, "response"), cut[T.RESPONSE_MASK].sum(-1), strict=True):
        if stop in before:
            assert after.endswith(stop) and stop not in after[:-1] and before.startswith(after)
        assert int(n) <= 16


def test_update_weights_takes_effect_and_sleep_wake(tiny_model_dir: Path) -> None:
    engine = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    params = SamplingParams(n=1, max_new_tokens=6)
    before = engine.generate(PROMPTS, params, seed=0)
    model = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    engine.update_weights([("lm_head.weight", model.lm_head.weight)])
    after = engine.generate(PROMPTS, params, seed=0)
    assert not torch.equal(before[T.ROLLOUT_LOGPROBS], after[T.ROLLOUT_LOGPROBS])
    with pytest.raises(KeyError, match="not a weight"):
        engine.update_weights([("nope.weight", torch.zeros(1))])
    engine.sleep()
    assert sum(p.numel() for p in engine.model.parameters()) == 0
    engine.wake()
    with pytest.raises(RuntimeError, match="without new weights"):
        engine.generate(PROMPTS, params, seed=0)
    engine.update_weights(model.state_dict().items())
    again = engine.generate(PROMPTS, params, seed=0)
    assert torch.equal(again[T.RESPONSE_IDS], after[T.RESPONSE_IDS])


def test_finished_rows_leave_the_batch_without_changing_the_others(tiny_model_dir: Path) -> None:
    """Greedy decode against transformers' `generate`: with an "EOS" that row 0 emits early, row 0 stops there
    (and leaves the batch and cache) while every other row continues token for token as generate has it."""
    from rlstages.engines.rollout.decode import decode, picker

    engine = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    enc = engine.tokenizer.pad(
        {"input_ids": [engine.tokenizer(text)["input_ids"] for text in ("1+2=", "What is 10 + 12?", "7 plus 8 is")]},
        padding=True,
        return_tensors="pt",
    )
    assert not bool(enc["attention_mask"].all())  # prompts of different lengths: left padding in play
    reference = engine.model.generate(**enc, do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    reference = reference[:, enc["input_ids"].shape[1] :].tolist()
    stop_id = reference[0][2]
    out = decode(engine.model, enc["input_ids"], enc["attention_mask"], 10, {stop_id}, picker(1.0, 0, 1.0, True))
    for row, ids in enumerate(out.ids):
        expected = reference[row][: reference[row].index(stop_id) + 1] if stop_id in reference[row] else reference[row]
        assert ids == expected
    assert len(out.ids[0]) <= 3 and max(len(ids) for ids in out.ids) == 10
    assert all(len(lps) == len(ids) and max(lps) <= 0 for ids, lps in zip(out.ids, out.logprobs, strict=True))


def test_rows_of_one_prompt_share_one_prefill(tiny_model_dir: Path) -> None:
    """A group's samples share their prompt's prefill: the first forward sees each distinct prompt once, and
    every row then decodes as it would alone (greedy: the same tokens and log-probs as one row per prompt)."""
    from rlstages.engines.rollout.decode import decode, picker

    engine = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    prompts = [engine.tokenizer(text)["input_ids"] for text in ("1+2=", "What is 10 + 12?", "7 plus 8 is")]
    rows = [prompts[i] for i in (1, 0, 1, 2, 0, 1)]
    seen: list[int] = []
    hook = engine.model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        enc = engine.tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")
        shared = decode(engine.model, enc["input_ids"], enc["attention_mask"], 8, set(), picker(1.0, 0, 1.0, True))
    finally:
        hook.remove()
    assert seen[0] == 3 and seen[1] == 6  # prefill of the 3 distinct prompts, then all 6 rows decode
    alone = engine.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    ref = decode(engine.model, alone["input_ids"], alone["attention_mask"], 8, set(), picker(1.0, 0, 1.0, True))
    for row, i in enumerate((1, 0, 1, 2, 0, 1)):
        assert shared.ids[row] == ref.ids[i]
        assert shared.logprobs[row] == pytest.approx(ref.logprobs[i], abs=1e-5)


def test_the_prefill_can_leave_one_cache_row_per_prompt(tiny_model_dir: Path) -> None:
    """`prefill_distinct` keeps one cache row per distinct prompt and says which row each input row takes: those
    rows, taken layer by layer, are `prefill`'s expanded cache (what the fast step copies into its buffers)."""
    from rlstages.engines.rollout.decode import prefill, prefill_distinct

    engine = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    prompts = [engine.tokenizer(text)["input_ids"] for text in ("1+2=", "What is 10 + 12?", "7 plus 8 is")]
    enc = engine.tokenizer.pad({"input_ids": [prompts[i] for i in (1, 0, 1, 2, 0, 1)]}, padding=True,
                               return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        cache, logits, mask, inverse = prefill_distinct(engine.model, enc["input_ids"], enc["attention_mask"])
        full, full_logits, full_mask = prefill(engine.model, enc["input_ids"], enc["attention_mask"])
    assert inverse is not None and len(inverse) == 6 and cache.layers[0].keys.shape[0] == 3
    assert torch.equal(logits, full_logits) and torch.equal(mask, full_mask)
    for mine, theirs in zip(cache.layers, full.layers, strict=True):
        assert torch.equal(mine.keys[inverse], theirs.keys) and torch.equal(mine.values[inverse], theirs.values)


def test_a_prefix_shared_by_all_prompts_goes_through_the_model_once(tiny_model_dir: Path) -> None:
    """Prompts that share a long prefix (a chat template's system turn): the prefix is forwarded once, each
    prompt's own tokens after it (with padding between), and each row decodes as that prompt alone would."""
    from rlstages.engines.rollout.decode import MIN_SHARED_PREFIX, decode, picker

    engine = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    head = "You are a calculator. Question: "
    texts = [head + q for q in ("1+2=", "what is 10 + 12?", "7 plus 8 is")]
    prompts = [engine.tokenizer(t)["input_ids"] for t in texts]
    seen: list[tuple[int, int]] = []
    hook = engine.model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        enc = engine.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
        shared = decode(engine.model, enc["input_ids"], enc["attention_mask"], 6, set(), picker(1.0, 0, 1.0, True))
    finally:
        hook.remove()
    prefix = len(engine.tokenizer(head)["input_ids"])
    assert prefix >= MIN_SHARED_PREFIX and seen[0] == (1, prefix)  # the shared prefix, once
    assert seen[1] == (3, max(map(len, prompts)) - prefix)  # then each prompt's own tokens
    for row, ids in enumerate(prompts):  # against each prompt decoded on its own (no padding, no sharing)
        ref = decode(
            engine.model,
            torch.tensor([ids]),
            torch.ones(1, len(ids), dtype=torch.long),
            6,
            set(),
            picker(1.0, 0, 1.0, True),
        )
        assert shared.ids[row] == ref.ids[0]
        assert shared.logprobs[row] == pytest.approx(ref.logprobs[0], abs=1e-5)


def test_a_prefix_shared_across_calls_is_forwarded_once_and_gives_the_same_bits(tiny_model_dir: Path) -> None:
    """The fast step prefills an evaluation's prompts in parts: with one `heads` memo across them the prefix all
    prompts share is forwarded once, and each part's cache and logits are those of a part computed alone."""
    from rlstages.engines.rollout.decode import prefill_distinct

    engine = HFRolloutEngine(tiny_model_dir, dtype="float32", apply_chat_template=False)
    head = "You are a calculator. Question: "
    parts = [["1+2=", "what is 10 + 12?"], ["7 plus 8 is", "3 * 4 ="]]
    seen: list[tuple[int, int]] = []
    hook = engine.model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    heads: dict[tuple[int, ...], object] = {}
    try:
        with torch.no_grad():
            for texts in parts:
                enc = engine.tokenizer.pad(
                    {"input_ids": [engine.tokenizer(head + t)["input_ids"] for t in texts]}, return_tensors="pt"
                )
                alone = prefill_distinct(engine.model, enc["input_ids"], enc["attention_mask"])
                memo = prefill_distinct(engine.model, enc["input_ids"], enc["attention_mask"], heads)
                assert torch.equal(alone[1], memo[1]) and torch.equal(alone[2], memo[2])
                for a, b in zip(alone[0].layers, memo[0].layers, strict=True):
                    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    finally:
        hook.remove()
    prefix = len(engine.tokenizer(head)["input_ids"])
    # each part alone forwards the prefix; with the memo only the first part does: 3 prefix forwards, not 4
    assert [shape for shape in seen if shape[0] == 1] == [(1, prefix)] * 3 and len(heads) == 1


def test_inverse_cdf_sampling_follows_the_distribution() -> None:
    from rlstages.engines.rollout.sampling import sample_rows

    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, float("-inf"), 2.0, -1.0]]).repeat(20000, 1)
    picked = sample_rows(logits)
    freq = torch.bincount(picked, minlength=5).float() / len(picked)
    assert freq[2] == 0  # never a masked token
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.015)
