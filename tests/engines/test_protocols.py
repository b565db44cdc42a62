"""Every engine class in every registry table against its Protocol (engines/base.py): each Protocol method
is there with the same parameters (names, order, kinds, defaults; extra trailing parameters need defaults),
each Protocol property is there. Imports the engine modules only (vLLM/SGLang/DeepSpeed/Megatron import
lazily inside the classes), so it runs on a CPU machine without those packages. No engine is built.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

from rlstages.engines import base
from rlstages.engines.registry import (
    REWARD_ENGINES,
    ROLLOUT_BACKENDS,
    TRAINING_BACKENDS,
    TRAINING_ENGINE,
)
from rlstages.engines.sync.protocol import EnginePush, WeightSync, WeightTarget
from rlstages.engines.sync.registry import ENGINE_PUSHERS, TRANSPORTS

HYBRID = "rlstages.engines.workers.hybrid:HybridEngine"
ROLLOUT_ENGINES = {name: entry.engine for name, entry in ROLLOUT_BACKENDS.items()}
CASES: list[tuple[str, type]] = [
    *[(path, base.RolloutEngine) for path in ROLLOUT_ENGINES.values()],
    (TRAINING_ENGINE, base.TrainingEngine),
    *[(entry.step, base.StepBackend) for entry in TRAINING_BACKENDS.values()],
    (REWARD_ENGINES["functions"], base.RewardFunctions),
    (REWARD_ENGINES["model"], base.RewardModel),
    (ROLLOUT_ENGINES["vllm"], base.GroupReceiver),  # its workers join split placement's sync group
    (ROLLOUT_ENGINES["sglang"], base.BucketReceiver),  # SGLang's workers join it with SGLang's own API
    (HYBRID, base.RolloutEngine),  # the hybrid engine serves both roles of its group
    (HYBRID, base.TrainingEngine),
    *[(path, WeightSync) for path in TRANSPORTS.values()],  # every weight transport
    *[(path, EnginePush) for path in ENGINE_PUSHERS.values()],  # every push into a colocated engine's processes
    *[(path, WeightTarget) for path in ROLLOUT_ENGINES.values()],  # what the transports need of the rollout side
    (HYBRID, WeightTarget),
]


def load(path: str) -> type:
    """The class at "module:Class"; a module that needs a package this interpreter lacks is skipped by name."""
    module, name = path.split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as err:  # pragma: no cover - every engine module imports lazily today
        pytest.skip(f"{module} needs the missing package {err.name!r} to import")


def protocol_members(protocol: type) -> dict[str, Any]:
    """The methods and properties a Protocol declares itself (not those of `Protocol`/`object`)."""
    return {
        k: v for k, v in vars(protocol).items() if not k.startswith("_") and (callable(v) or isinstance(v, property))
    }


def params(fn: Any) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of each parameter after `self`."""
    return [(p.name, p.kind, p.default) for p in list(inspect.signature(fn).parameters.values())[1:]]


def test_every_registered_backend_is_checked() -> None:
    checked = {path for path, _ in CASES}
    assert set(ROLLOUT_ENGINES.values()) | set(REWARD_ENGINES.values()) <= checked
    assert {entry.step for entry in TRAINING_BACKENDS.values()} | {TRAINING_ENGINE} <= checked
    assert set(TRANSPORTS.values()) | set(ENGINE_PUSHERS.values()) <= checked


@pytest.mark.parametrize(("path", "protocol"), CASES, ids=[f"{p.split(':')[1]}-{q.__name__}" for p, q in CASES])
def test_engine_implements_its_protocol(path: str, protocol: type) -> None:
    cls = load(path)
    members = protocol_members(protocol)
    assert members, f"{protocol.__name__} declares nothing"
    for name, member in members.items():
        assert hasattr(cls, name), f"{path} lacks {protocol.__name__}.{name}"
        if isinstance(member, property):
            continue
        want, got = params(member), params(getattr(cls, name))
        extra = got[len(want) :]
        assert got[: len(want)] == want, f"{path}.{name}{inspect.signature(getattr(cls, name))} != {want}"
        assert all(default is not inspect.Parameter.empty for _, _, default in extra), f"{path}.{name}: {extra}"


def test_a_mismatch_is_caught() -> None:
    """The check itself fails on a wrong default (the Protocols' old `temperature: float = 1.0`)."""

    class Wrong:
        def logprobs(self, batch: Any, temperature: float = 1.0) -> Any: ...

    want = params(base.TrainingEngine.logprobs)
    assert params(Wrong.logprobs) != want
