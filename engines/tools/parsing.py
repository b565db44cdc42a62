"""Tool calls parsed from the policy's text, Hermes/Qwen style: `<tool_call>{"name": .., "arguments": ..}</tool_call>`.

Never raises: a block that is not JSON, lacks a name, has non-object arguments or is left unclosed becomes a
`ToolCall` with `parse_error` set, so the runner can answer it with an error observation.

Non-goal: other formats (Llama `<|python_tag|>`, Mistral `[TOOL_CALLS]`); `fmt` names the format so they can be added.
"""

from __future__ import annotations

import json
from typing import Any

from rlstages.engines.tools.base import ToolCall

FORMATS = ("hermes",)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """Every `<tool_call>` block of `text`, in order; an unknown `fmt` is a ValueError (a config error, not text).

    A block ends at `</tool_call>`; one left open ends at the next `<tool_call>` or the end of the text."""
    if fmt not in FORMATS:
        raise ValueError(f"tool-call format {fmt!r} is not supported; supported: {', '.join(FORMATS)}")
    if not isinstance(text, str):
        return []
    calls = []
    start = text.find(_OPEN)
    while start >= 0:
        body_start = start + len(_OPEN)
        reopen = text.find(_OPEN, body_start)
        close = text.find(_CLOSE, body_start, len(text) if reopen < 0 else reopen)  # each char scanned once
        if close >= 0:
            calls.append(_parse_block(text[body_start:close].strip(), closed=True))
            start = text.find(_OPEN, close + len(_CLOSE))
        else:
            end = reopen if reopen >= 0 else len(text)
            calls.append(_parse_block(text[body_start:end].strip(), closed=False))
            start = reopen
    return calls


def _parse_block(body: str, closed: bool) -> ToolCall:
    """One block's JSON -> ToolCall; every failure is recorded in `parse_error`."""
    if not closed:
        return ToolCall(name="", raw_arguments=body, arguments=None, parse_error="unclosed <tool_call> block")
    try:
        obj: Any = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        error = f"invalid JSON in <tool_call> ({detail})"
        return ToolCall(name="", raw_arguments=body, arguments=None, parse_error=error)
    if not isinstance(obj, dict):
        return ToolCall(name="", raw_arguments=body, arguments=None, parse_error="<tool_call> must hold a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(name="", raw_arguments=body, arguments=None, parse_error='<tool_call> lacks a string "name"')
    if "arguments" not in obj:
        args: Any = obj.get("parameters", {})  # some models write "parameters"
    else:
        args = obj["arguments"]
    if isinstance(args, str):  # arguments given as a JSON string (OpenAI's wire format)
        raw = args
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return ToolCall(name=name, raw_arguments=raw, arguments=None, parse_error="arguments are not valid JSON")
    else:
        raw = json.dumps(args, ensure_ascii=False)
    if not isinstance(args, dict):
        return ToolCall(
            name=name,
            raw_arguments=raw,
            arguments=None,
            parse_error=f"arguments must be a JSON object, got {type(args).__name__}",
        )
    return ToolCall(name=name, raw_arguments=raw, arguments=args, parse_error=None)
