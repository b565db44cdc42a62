"""`engines/compiled.py`, the compiled-function sets behind `fused_logits` and `fused_layers`: a function that
does not compile is off for good after one try; a new shape past dynamo's recompile limit runs eagerly for that
call only, while the shapes compiled before keep running compiled."""

from __future__ import annotations

import pytest
import torch

from rlstages.engines.compiled import CompiledFunctions


def double(x: torch.Tensor) -> torch.Tensor:
    """Twice x."""
    return x * 2


@pytest.fixture
def kernels() -> CompiledFunctions:
    torch._dynamo.reset()
    k = CompiledFunctions({"double": double}, "test kernel", devices=("cpu",))
    k.backend = "aot_eager"
    return k


def test_a_function_that_fails_to_compile_is_tried_once(kernels: CompiledFunctions) -> None:
    tries = []

    def broken(gm, example_inputs):
        tries.append(1)
        raise RuntimeError("no compiler")

    kernels.backend = broken
    assert kernels.run("double", torch.ones(3)) is None
    assert kernels.run("double", torch.ones(4)) is None
    assert kernels.failed == {"double"} and len(tries) == 1


def test_past_the_recompile_limit_only_new_shapes_run_eagerly(kernels: CompiledFunctions) -> None:
    """With a recompile limit of 1, a second dtype (a new graph) is refused for that call alone: the first dtype
    still runs compiled and nothing is marked failed."""
    x = torch.arange(4.0)
    with torch._dynamo.config.patch(recompile_limit=1):
        torch.testing.assert_close(kernels.run("double", x), x * 2)
        assert kernels.run("double", x.to(torch.float64)) is None
        assert kernels.over_limit == {"double"} and not kernels.failed
        torch.testing.assert_close(kernels.run("double", torch.arange(7.0)), torch.arange(7.0) * 2)


def test_it_takes_tensors_on_its_devices_while_enabled(kernels: CompiledFunctions) -> None:
    assert kernels.takes(torch.ones(1))
    kernels.enabled = False
    assert not kernels.takes(torch.ones(1)) and kernels.run("double", torch.ones(1)) is None
    assert not CompiledFunctions({}, "gpu only").takes(torch.ones(1))


def test_a_run_turns_the_compiled_log_prob_pass_off_in_its_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """`RLSTAGES_COMPILED_LOGPROBS=0` (the GPU demo's with/without comparison): the fused log-prob kernels are off
    where the module is imported, and the driver passes the setting on to every worker it starts."""
    import subprocess
    import sys

    from rlstages.engines.algorithms.fused_logits import COMPILED_ENV, KERNELS
    from rlstages.engines.runtime.worker_env import worker_env

    check = "from rlstages.engines.algorithms.fused_logits import KERNELS; print(KERNELS.enabled)"
    for value, enabled in (("0", "False"), ("1", "True")):
        monkeypatch.setenv(COMPILED_ENV, value)
        out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == enabled
        assert worker_env(1)[COMPILED_ENV] == value
    monkeypatch.delenv(COMPILED_ENV)
    assert KERNELS.enabled and COMPILED_ENV not in worker_env(1)
