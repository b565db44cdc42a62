"""Parsing tool calls (Hermes `<tool_call>` blocks): several in one message, errors recorded on the call and never
raised, garbage survived."""

from __future__ import annotations

import json
import random

import pytest

from rlstages.engines.tools import parse_tool_calls


def test_parse_several_calls_in_one_message() -> None:
    text = (
        "I will compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "12*13"}}\n</tool_call>\n'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call> done'
    )
    calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["calculator", "python"]
    assert calls[0].arguments == {"expression": "12*13"} and calls[0].parse_error is None
    assert json.loads(calls[0].raw_arguments) == {"expression": "12*13"}
    assert calls[1].arguments == {"code": "print(1)"}  # arguments given as a JSON string


@pytest.mark.parametrize(
    ("text", "name", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "", "invalid JSON"),
        ('<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>', "calculator", "JSON object, got list"),
        ('<tool_call>{"name": "calculator", "arguments": 3}</tool_call>', "calculator", "JSON object, got int"),
        ('<tool_call>{"name": "calculator", "arguments": "{oops"}</tool_call>', "calculator", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "", 'lacks a string "name"'),
        ("<tool_call>[1, 2]</tool_call>", "", "must hold a JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+', "", "unclosed"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "", "invalid JSON"),
    ],
)
def test_parse_errors_are_recorded_not_raised(text: str, name: str, error: str) -> None:
    (call,) = parse_tool_calls(text)
    assert call.name == name and call.arguments is None
    assert call.parse_error is not None and error in call.parse_error


def test_parse_survives_garbage() -> None:
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"arguments"', "[", "]", '"', "\\", "x", "\n"]
    assert parse_tool_calls("no calls here") == [] and parse_tool_calls("") == []
    assert parse_tool_calls(None) == []  # type: ignore[arg-type]
    found = 0
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        for call in parse_tool_calls(text):  # never raises
            found += 1
            assert (call.arguments is None) == (call.parse_error is not None)
    assert found > 500
    with pytest.raises(ValueError, match="not supported"):
        parse_tool_calls("x", fmt="mistral")
