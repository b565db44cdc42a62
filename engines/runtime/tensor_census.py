"""What a worker's engine holds in tensors: the bytes of the distinct storages reachable from the engine object
(weights, gradients, optimizer states, ZeRO's flat partitions and buckets, caches), each storage once. Used by the
stage profiles (`trainer.profile` with memory: `peak_rss.json`'s `engine_tensor_bytes`) and by the memory plan's
checks against measurement (tests/engines/plan_check.py, tests/cluster/plan_twins.py)."""

from __future__ import annotations

import types
from collections import deque
from pathlib import Path
from typing import Any

import torch

# Not followed: plain values, classes, modules, functions and frames (what they reach is not the engine's own).
_SKIP: tuple[type, ...] = (
    str,
    bytes,
    int,
    float,
    bool,
    complex,
    type(None),
    type,
    types.ModuleType,
    types.FunctionType,
)
_SKIP += (types.BuiltinFunctionType, types.MethodType, types.CodeType, types.FrameType, Path)


def reachable_tensor_bytes(root: Any, limit: int = 500_000) -> int:
    """Bytes of the distinct tensor storages reachable from `root` through attributes, containers and tensors'
    own attributes (`.grad`, `main_grad`, ZeRO's `ds_tensor`); at most `limit` objects are visited."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack: deque[Any] = deque([root])
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                storage = obj.untyped_storage()
                if storage.data_ptr():
                    storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
            if obj.grad is not None:
                stack.append(obj.grad)
            stack.extend(getattr(obj, "__dict__", {}).values())
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset | deque):
            stack.extend(obj)
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                stack.extend(attrs.values())
            for slot in getattr(type(obj), "__slots__", ()):
                if isinstance(slot, str) and hasattr(obj, slot):
                    stack.append(getattr(obj, slot))
    return sum(storages.values())
