"""Names of reward functions -> import paths, resolved lazily, plus user functions given as `module:function`.

The registry holds strings, not functions, so naming a reward imports only its own module (and so that a
worker process can resolve the same name). Add an entry to `REWARD_FUNCTIONS` to register a built-in.

Two signatures are accepted: the project's `fn(prompt, response, ground_truth, **extra)` and verl's
`compute_score(data_source, solution_str, ground_truth, extra_info=None)`; `call_reward_fn` tells them apart by
parameter names and passes each what it takes.

Non-goals: timeouts and weighting (see `rlstages.engines.rewards.scorer`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from rlstages.engines.imports import ImportTargetError, import_object

RewardFn = Callable[..., float | dict[str, float]]

REWARD_FUNCTIONS: dict[str, str] = {
    "last_integer": "rlstages.engines.rewards.functions:last_integer",
    "math_verify": "rlstages.engines.rewards.functions:math_verify",
    "exact_match": "rlstages.engines.rewards.functions:exact_match",
    "boxed_format": "rlstages.engines.rewards.functions:boxed_format",
    "tool_call_format": "rlstages.engines.rewards.functions:tool_call_format",
    "digit_ratio": "rlstages.engines.rewards.functions:digit_ratio",
    "gsm8k": "rlstages.engines.rewards.functions:gsm8k",
    "by_data_source": "rlstages.engines.rewards.functions:by_data_source",
    "choice": "rlstages.engines.rewards.functions:choice",
}

# Built-ins that compare against a ground truth: data checks refuse rows without one when these are used.
NEEDS_GROUND_TRUTH = frozenset({"last_integer", "math_verify", "exact_match", "gsm8k", "by_data_source", "choice"})


def _import_target(target: str, field: str) -> RewardFn:
    """Import `package.module:attr[.attr]` (`engines.imports.import_object`) and check it is callable; every
    failure is a one-line ImportTargetError (a ValueError) starting with `field`."""
    obj = import_object(target, field, expected="function")
    if not callable(obj):
        raise ImportTargetError(f"{field}: {target!r} is not callable")
    return obj


def resolve_reward_fn(name: str, field: str | None = None) -> RewardFn:
    """Return the function registered as `name`, or the user function `name = "package.module:function"`.

    Raises ValueError (one line, starting with `field`, else "reward function 'name'") for an unknown name
    or a target that cannot be imported.
    """
    where = field or f"reward function {name!r}"
    if ":" in name:
        return _import_target(name, where)
    target = REWARD_FUNCTIONS.get(name)
    if target is None:
        known = ", ".join(sorted(REWARD_FUNCTIONS))
        prefix = f"{field}: " if field else ""
        raise ValueError(
            f"{prefix}unknown reward function {name!r}; registered: {known} (or give 'package.module:function')"
        )
    return _import_target(target, where)


def _is_verl_style(fn: RewardFn) -> bool:
    """True for verl's `compute_score(data_source, solution_str, ground_truth, extra_info)` signature."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "solution_str" in params or next(iter(params), "") == "data_source"


def call_reward_fn(
    fn: RewardFn,
    prompt: str,
    response: str,
    ground_truth: str,
    data_source: str = "",
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Call a reward function of either signature; per-sample `data_source`/`extra_info` go to the project's
    functions as keywords only when they accept them (named or `**extra`)."""
    if _is_verl_style(fn):
        return fn(
            data_source=data_source, solution_str=response, ground_truth=ground_truth, extra_info=extra_info, **kwargs
        )
    try:
        params: Mapping[str, inspect.Parameter] = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    open_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    context = {"data_source": data_source, "extra_info": extra_info or {}}
    extra = {k: v for k, v in context.items() if open_kw or k in params}
    return fn(prompt, response, ground_truth, **extra, **kwargs)
