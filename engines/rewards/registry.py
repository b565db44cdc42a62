"""Names of reward functions -> import paths, resolved lazily, plus user functions given as `module:function`.

The registry holds strings, not functions, so naming a reward imports only its own module (and so that a
worker process can resolve the same name). Add an entry to `REWARD_FUNCTIONS` to register a built-in.

Non-goals: calling the functions, timeouts, weighting (see `rlstages.engines.rewards.scorer`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., float | dict[str, float]]

REWARD_FUNCTIONS: dict[str, str] = {
    "last_integer": "rlstages.engines.rewards.functions:last_integer",
    "math_verify": "rlstages.engines.rewards.functions:math_verify",
    "exact_match": "rlstages.engines.rewards.functions:exact_match",
    "boxed_format": "rlstages.engines.rewards.functions:boxed_format",
    "digit_ratio": "rlstages.engines.rewards.functions:digit_ratio",
}


def _import_target(target: str, name: str) -> RewardFn:
    """Import `package.module:attr[.attr]`; every failure is a one-line ValueError naming what failed."""
    module_name, _, attr_path = target.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"reward function {name!r}: expected 'package.module:function', got {target!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or whatever the module raised while importing
        detail = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(
            f"reward function {name!r}: cannot import module {module_name!r} ({type(err).__name__}: {detail})"
        ) from err
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise ValueError(
                f"reward function {name!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(obj):
        raise ValueError(f"reward function {name!r}: {target!r} is not callable")
    return obj


def resolve_reward_fn(name: str) -> RewardFn:
    """Return the function registered as `name`, or the user function `name = "package.module:function"`.

    Raises ValueError (one line) for an unknown name or a target that cannot be imported.
    """
    if ":" in name:
        return _import_target(name, name)
    target = REWARD_FUNCTIONS.get(name)
    if target is None:
        known = ", ".join(sorted(REWARD_FUNCTIONS))
        raise ValueError(f"unknown reward function {name!r}; registered: {known} (or give 'package.module:function')")
    return _import_target(target, name)
