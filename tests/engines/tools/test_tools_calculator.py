"""The calculator tool: arithmetic answers, and refusals of everything else (names, calls, huge powers)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlstages.engines.tools.calculator import Calculator, CalculatorError, evaluate


def _call(expression: object):
    return asyncio.run(Calculator().call({"expression": expression}))


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("123*456", "56088"),
        ("  12 * (3 + 4) ", "84"),
        ("-(3+4)*2", "-14"),
        ("+5 - -2", "7"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("1/4", "0.25"),
        ("2**10", "1024"),
        ("2**-1", "0.5"),
        ("2.5 * 4", "10.0"),
        ("987 * 654 + 321", str(987 * 654 + 321)),
        ("3**600", str(3**600)),
    ],
)
def test_calculator_answers(expression: str, expected: str) -> None:
    result = _call(expression)
    assert result.error is None, result.error
    assert result.text == expected


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('true')", "Call"),
        ("x + 1", "Name"),
        ("(1).real", "Attribute"),
        ("abs(-1)", "Call"),
        ("'a' * 3", "only numbers"),
        ("[1][0]", "not allowed"),
        ("True + 1", "only numbers"),
        ("1 if 1 else 2", "IfExp"),
        ("lambda: 1", "Lambda"),
        ("1 < 2", "Compare"),
        ("2 ^ 3", "use **"),
        ("1j * 2", "only numbers"),
        ("2**100000", "exponent"),
        ("10**10**10", "exponent"),
        ("99999**999", "too large"),
        ("(2**4000) * (2**4000)", "too large"),
        ("1e308 * 10", "finite"),
        ("(-8) ** 0.5", "complex"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("1 +", "not a valid expression"),
        ("(" * 240 + "1" + ")" * 240, "nested parentheses"),
        ("1+" * 300 + "1", "longer than"),
    ],
)
def test_calculator_refuses(expression: str, reason: str) -> None:
    result = _call(expression)
    assert result.error is not None and reason in result.error, result
    assert result.text.startswith("Error: ")


def test_calculator_refuses_non_strings_and_stays_fast() -> None:
    assert _call(12).error == "expression must be a string"
    start = time.perf_counter()
    for expression in ["9**9**9", "2**1000 * 2**1000 * 2**1000 * 2**1000 * 2**1000", "(10**300)**5"]:
        with pytest.raises(CalculatorError):
            evaluate(expression)
    assert time.perf_counter() - start < 5.0  # computed from sizes: doing the work would take hours


def test_calculator_schema_is_openai_style() -> None:
    schema = Calculator().schema()
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
