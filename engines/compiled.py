"""A set of pure tensor functions that `torch.compile` fuses on a GPU, each compiled on first use, with the
caller's eager code as the fallback wherever a function does not compile.

`engines/algorithms/fused_logits.py` (the log-prob + entropy pass), `engines/models/fused_layers.py` (the
decoder's RMSNorm, SwiGLU and rotary embedding) and `engines/training/sr_adamw.py` (the bf16 AdamW step, on CPU
too) each hold one. A function whose compilation fails is off for the
rest of the process (the compiler would fail again); a call that only passes dynamo's recompile limit (a new shape
after too many) runs eagerly for that call alone and the compiled shapes keep running compiled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from rlstages.engines.tensordict_import import register_with_dynamo

log = logging.getLogger(__name__)


class CompiledFunctions:
    """`functions` compiled on first use (shapes dynamic, whole graphs) by `backend` for tensors on `devices`;
    `enabled` turns the set off (the benches time the eager path with it)."""

    def __init__(self, functions: Mapping[str, Callable[..., Any]], label: str, devices: tuple[str, ...] = ("cuda",)):
        self.functions = dict(functions)
        self.label = label
        self.devices = devices
        self.enabled = True
        self.backend: str | Callable[..., Any] = "inductor"
        self.compiled: dict[str, Callable[..., Any]] = {}
        self.failed: set[str] = set()
        self.over_limit: set[str] = set()

    def takes(self, t: Tensor) -> bool:
        """Whether calls on `t` go through the compiled functions: the set is on and `t` is on one of `devices`."""
        return self.enabled and t.device.type in self.devices

    def run(self, name: str, *args: Any) -> Any:
        """`functions[name](*args)` compiled, or None (the caller computes eagerly) where the set is off, the
        function failed to compile before, or it fails now."""
        if not self.enabled or name in self.failed:
            return None
        if name not in self.compiled:
            fn = self.functions[name]
            register_with_dynamo()
            self.compiled[name] = torch.compile(fn, backend=self.backend, dynamic=True, fullgraph=True)
        try:
            return self.compiled[name](*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            if name not in self.over_limit:
                self.over_limit.add(name)
                log.warning("%s %s: dynamo's recompile limit; new shapes run eagerly", self.label, name)
            return None
        except Exception as exc:  # noqa: BLE001 - no Triton / compiler here: the eager code computes the same values
            self.mark_failed(name, exc)
            return None

    def mark_failed(self, name: str, exc: BaseException) -> None:
        """Turn `name` off for this process (its compilation failed), with a warning naming the error."""
        self.failed.add(name)
        log.warning("%s %s did not compile (%s); using the eager code", self.label, name, exc)
