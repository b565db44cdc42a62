"""Built-in reward functions: plain `(prompt, response, ground_truth, **extra) -> float` checkers.

Each function is pure and cheap to import (math-verify is imported on first use), so a worker process
of `RewardScorer` can resolve it by name. Options come in as keyword arguments from the config; keys a
function does not know are ignored, as the reward signature allows extra per-sample context.

Non-goals: timeouts and error isolation (the scorer's process pool does that), weighting, batching.
"""

from __future__ import annotations

import re
import threading
from typing import Any

# An integer, with thousands separators ("3,000") read as one number. A leading "-" is a sign only when
# it does not follow a letter or digit, so "20-5" reads as 20 and 5 while "x = -5" reads as -5.
_INTEGER = re.compile(r"(?:(?<![0-9A-Za-z])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)")
_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_FRACTION = re.compile(r"[-+]?\s*\\d?frac\s*\{\s*-?\d+\s*\}\s*\{\s*-?\d+\s*\}|[-+]?\d+\s*/\s*\d+")


def _to_int(text: str) -> int:
    """Parse an integer ground truth such as "42", "-7", "3,000" or "12.0"; raise ValueError otherwise."""
    cleaned = text.strip().replace(",", "")
    try:
        return int(cleaned)
    except ValueError:
        value = float(cleaned)  # raises ValueError on non-numbers
        if not value.is_integer():
            raise ValueError(f"ground truth {text!r} is not an integer") from None
        return int(value)


def last_integer(prompt: str, response: str, ground_truth: str, **extra: Any) -> float:
    """1.0 if the last integer in the response equals the integer ground truth, else 0.0.

    This is the demo task's checker; "3,000" counts as 3000. A non-integer ground truth raises ValueError.
    """
    target = _to_int(ground_truth)
    matches = _INTEGER.findall(response)
    if not matches:
        return 0.0
    return 1.0 if int(matches[-1].replace(",", "")) == target else 0.0


def math_verify(
    prompt: str,
    response: str,
    ground_truth: str,
    timeout_seconds: int | None = 5,
    **extra: Any,
) -> float:
    r"""1.0 if math-verify finds the response's answer equivalent to the ground truth, else 0.0.

    Handles `\boxed{}`, `$...$`, fractions and thousands separators. Its signal-based timeout is used only
    in the main thread (as in a pool worker); elsewhere it is off and the caller must bound the time.
    """
    from math_verify import parse, verify

    limit = timeout_seconds if threading.current_thread() is threading.main_thread() else None
    gold = parse(ground_truth, parsing_timeout=limit)
    if not gold:  # bare LaTeX such as "x^2+1" is only extracted inside math delimiters
        gold = parse(f"${ground_truth}$", parsing_timeout=limit)
    if not gold:
        raise ValueError(f"math-verify could not parse the ground truth {ground_truth!r}")
    answer = parse(response, parsing_timeout=limit)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=limit) else 0.0


def exact_match(prompt: str, response: str, ground_truth: str, ignore_case: bool = False, **extra: Any) -> float:
    """1.0 if the stripped response equals the stripped ground truth (optionally ignoring case)."""
    got, want = response.strip(), ground_truth.strip()
    if ignore_case:
        got, want = got.casefold(), want.casefold()
    return 1.0 if got == want else 0.0


def boxed_contents(text: str) -> list[str]:
    r"""The contents of every `\boxed{...}` in `text`, with nested braces matched; unclosed ones are skipped."""
    found = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for pos in range(start, len(text)):
            if text[pos] == "{":
                depth += 1
            elif text[pos] == "}":
                depth -= 1
                if depth == 0:
                    found.append(text[start:pos])
                    break
    return found


def _is_number(content: str) -> bool:
    r"""True if `content` is a plain number: 42, -3.5, 3,000, 1/2 or \frac{1}{2} (spaces and $ ignored)."""
    content = content.strip().strip("$").strip()
    return bool(_NUMBER.fullmatch(content) or _FRACTION.fullmatch(content))


def boxed_format(prompt: str, response: str, ground_truth: str, require_number: bool = False, **extra: Any) -> float:
    r"""1.0 if the response has a `\boxed{...}` with non-empty content (a number, if `require_number`)."""
    for content in boxed_contents(response):
        if content.strip() and (not require_number or _is_number(content)):
            return 1.0
    return 0.0


def tool_call_format(
    prompt: str, response: str, ground_truth: str, extra_info: dict[str, Any] | None = None, **extra: Any
) -> float:
    """1.0 if the multi-turn trajectory made a tool call that parsed and ran without an error, else 0.0: a
    format reward (weight it small) so the groups of a model that rarely writes a valid call have variance.
    Reads the trajectory record the reward stage puts in `extra_info["trajectory"]` for multi-turn rollouts."""
    record = (extra_info or {}).get("trajectory")
    if not isinstance(record, dict):
        raise ValueError("tool_call_format scores multi-turn rollouts: this row has no trajectory record")
    return 1.0 if any(c["parsed"] and c["error"] is None for c in record.get("tool_calls", ())) else 0.0


def digit_ratio(prompt: str, response: str, ground_truth: str, **extra: Any) -> float:
    """Fraction of the response's characters that are digits: a dense toy reward for smoke runs on tiny
    random models (verl's digit-completion idea), where an exact checker would always score 0."""
    return sum(ch.isdigit() for ch in response) / len(response) if response else 0.0


_GSM8K_ANSWER = re.compile(r"#### *(-?[0-9.,]+)")
GSM8K_SOURCES = frozenset({"openai/gsm8k", "gsm8k"})
# verl's math family: math-verify handles \boxed{}, $...$ and plain answers alike.
MATH_SOURCES = frozenset(
    {
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
        "math",
        "math_dapo",
        "math_dapo_reasoning",
        "numina_aops_forum",
        "numina_synthetic_math",
        "numina_amc_aime",
        "numina_synthetic_amc",
        "numina_cn_k12",
        "numina_olympiads",
        "aime24",
        "aime25",
    }
)


def gsm8k(prompt: str, response: str, ground_truth: str, **extra: Any) -> float:
    """1.0 if the response's last `#### answer` (GSM8K's format) equals the numeric ground truth, else 0.0."""
    found = _GSM8K_ANSWER.findall(response)
    if not found:
        return 0.0
    answer = found[-1].replace(",", "").rstrip(".")
    try:
        return 1.0 if float(answer) == float(ground_truth.replace(",", "").strip()) else 0.0
    except ValueError:
        return 0.0


def by_data_source(prompt: str, response: str, ground_truth: str, data_source: str = "", **extra: Any) -> float:
    """Verl's default reward dispatch by the row's `data_source`: GSM8K's `#### answer`, math-verify for the
    math family (MATH, MATH-500, DAPO, Numina, AIME); any other source raises ValueError naming it."""
    if data_source in GSM8K_SOURCES:
        return gsm8k(prompt, response, ground_truth)
    if data_source in MATH_SOURCES or data_source.startswith(("aime", "math")):
        return math_verify(prompt, response, ground_truth, **{k: v for k, v in extra.items() if k == "timeout_seconds"})
    known = ", ".join(sorted(GSM8K_SOURCES | MATH_SOURCES))
    raise ValueError(f"by_data_source: no built-in reward for data_source {data_source!r} (known: {known})")


def choice(
    prompt: str, response: str, ground_truth: str, extra_info: dict[str, Any] | None = None, **extra: Any
) -> float:
    """1.0 if the response names the ground truth and no other of the row's `extra_info["choices"]` (words,
    case-insensitive; without choices: the ground truth among the response's words)."""
    choices = {str(c).casefold() for c in (extra_info or {}).get("choices", [])} | {ground_truth.strip().casefold()}
    named = {w for w in re.findall(r"[^\W_]+", response.casefold()) if w in choices}
    return 1.0 if named == {ground_truth.strip().casefold()} else 0.0
