"""Per-row data reaches reward functions: verl's `compute_score(data_source, solution_str, ground_truth,
extra_info)` and the project's own signature, through the process-pool scorer; the built-in dispatch by
`data_source` (GSM8K's `#### answer`, math-verify for the math family)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from rlstages.engines.rewards.functions import by_data_source, gsm8k
from rlstages.engines.rewards.registry import call_reward_fn
from rlstages.engines.rewards.scorer import RewardScorer

MODULE = "rlstages_test_verl_rewards"
SOURCE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: the score depends on every argument, so a dropped one shows."""
    bonus = float(extra_info["bonus"]) if extra_info else 0.0
    hit = solution_str.strip() == ground_truth
    return {"score": float(hit) + bonus, "source_len": float(len(data_source))}


def own(prompt, response, ground_truth, data_source=""):
    """The project's signature naming data_source but no extra_info (which it must not receive)."""
    return 1.0 if data_source == "keep" and response == ground_truth else 0.0
'''


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("verl_rewards")
    (root / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    sys.path.insert(0, str(root))
    yield MODULE
    sys.path.remove(str(root))
    sys.modules.pop(MODULE, None)


def test_gsm8k_reads_the_last_hash_answer() -> None:
    assert gsm8k("", "so 3 + 4 = 7\n#### 7", "7") == 1.0
    assert gsm8k("", "#### 1,200.", "1200") == 1.0
    assert gsm8k("", "#### 6\n#### 8", "6") == 0.0  # the last one counts
    assert gsm8k("", "the answer is 7", "7") == 0.0  # no #### marker: strict, as verl's default


def test_by_data_source_dispatches_and_names_unknown_sources() -> None:
    assert by_data_source("", "#### 12", "12", data_source="openai/gsm8k") == 1.0
    assert by_data_source("", r"so \boxed{\frac{1}{2}}", "0.5", data_source="lighteval/MATH") == 1.0
    assert by_data_source("", r"\boxed{3}", "4", data_source="HuggingFaceH4/MATH-500") == 0.0
    with pytest.raises(ValueError, match="no built-in reward for data_source 'my/task'"):
        by_data_source("", "#### 1", "1", data_source="my/task")


def test_call_reward_fn_passes_each_signature_what_it_takes(module: str) -> None:
    mod = __import__(module)
    out = call_reward_fn(mod.compute_score, "p", " 5 ", "5", "openai/gsm8k", {"bonus": 0.25})
    assert out == {"score": 1.25, "source_len": 12.0}
    assert call_reward_fn(mod.own, "p", "5", "5", "keep", {"bonus": 1}) == 1.0
    assert call_reward_fn(mod.own, "p", "5", "5", "other", {}) == 0.0


def test_scorer_sends_data_source_and_extra_info_to_workers(module: str) -> None:
    scorer = RewardScorer(
        [(f"{module}:compute_score", 1.0, {}), ("by_data_source", 1.0, {})], timeout_seconds=30, fallback_score=-1.0
    )
    try:
        result = scorer.score(
            ["q1", "q2", "q3"],
            ["#### 4", "#### 5", r"\boxed{9}"],
            ["#### 4", "4", "9"],
            ["openai/gsm8k", "openai/gsm8k", "math_dapo"],
            [{"bonus": 0.5}, {}, {"bonus": 0.0}],
        )
    finally:
        scorer.close()
    assert result.components[f"{module}:compute_score"] == [1.5, 0.0, 0.0]
    assert result.components[f"{module}:compute_score/source_len"] == [12.0, 12.0, 9.0]
    assert result.components["by_data_source"] == [0.0, 0.0, 1.0]
    assert result.scores == [1.5, 0.0, 1.0]
    assert result.metrics["reward/failures"] == 0.0
