"""A calculator tool: arithmetic on numbers only, evaluated from Python's AST (never `eval`).

Allowed: int and float literals, + - * / // % **, unary + and -, parentheses. Powers are bounded (exponent
magnitude and the result's size), as is every intermediate integer, so no input can hang the worker or eat its
memory. Anything else (names, attributes, calls, subscripts, comparisons, strings, `^`) is refused.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from rlstages.engines.tools.base import ToolResult

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_INT_BITS = 4096  # about 1233 decimal digits

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
    """An expression the calculator refuses, with a message the policy can read."""


def _check_size(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result too large (over {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return value


def _power(base: int | float, exp: int | float) -> int | float:
    if abs(exp) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exp} too large (limit {MAX_EXPONENT})")
    if isinstance(base, int) and isinstance(exp, int) and exp > 0:
        if base not in (0, 1, -1) and (abs(base).bit_length() - 1) * exp > MAX_INT_BITS:
            raise CalculatorError(f"result too large (over {MAX_INT_BITS} bits)")
    try:
        out = base**exp
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    if isinstance(out, complex):
        raise CalculatorError("result is complex (negative number to a fractional power)")
    return out


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        op = _BINARY.get(type(node.op))
        if op is None:
            hint = " (use ** for powers)" if isinstance(node.op, ast.BitXor) else ""
            raise CalculatorError(f"operator {type(node.op).__name__} is not allowed{hint}")
        try:
            return _check_size(op(left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    raise CalculatorError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def evaluate(expression: object) -> int | float:
    """The value of an arithmetic expression; a CalculatorError (readable message) for anything else."""
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not a valid expression ({exc.msg})") from None
    except (ValueError, RecursionError, MemoryError):
        raise CalculatorError("not a valid expression") from None
    try:
        return _eval(tree)
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def format_number(value: int | float) -> str:
    """Integers exactly; floats by repr, whole floats without a spurious `.0` kept (2.0 -> 2.0)."""
    return str(value) if isinstance(value, int) else repr(value)


class Calculator:
    """The `calculator` tool: `{"expression": "12 * (3 + 4)"}` -> `"84"`; stateless, shared by trajectories."""

    name = "calculator"
    stateful = False

    def schema(self) -> dict[str, Any]:
        """OpenAI-style function schema."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "e.g. 123 * 456"}},
                    "required": ["expression"],
                },
            },
        }

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Evaluate `arguments["expression"]`; a refused expression is an error result, not an exception."""
        try:
            return ToolResult(text=format_number(evaluate(arguments.get("expression"))))
        except CalculatorError as exc:
            return ToolResult(text=f"Error: {exc}", error=str(exc))
