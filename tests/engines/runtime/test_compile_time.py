"""`compile_seconds`: the process's time in `torch.compile` grows by a compile and not by a call of the compiled
function (the ETA leaves the first step's compiling out: `flows.progress`)."""

from __future__ import annotations

import torch

from rlstages.engines.runtime.compile_time import compile_seconds


def test_a_compile_is_counted_and_a_compiled_call_is_not() -> None:
    fn = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="eager")  # dynamo alone: no C++ build
    before = compile_seconds()
    x = torch.ones(3)
    fn(x)
    compiled = compile_seconds()
    assert compiled > before
    fn(x + 1)  # the same shapes: no recompile
    assert compile_seconds() == compiled
