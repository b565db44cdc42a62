"""The python tool's isolation layers: a missing layer refuses the call in one line (or `auto` falls back to the
launcher), the pre-flight reports the layers and records an opt-out, and the interpreter a call runs. Run again as
an ordinary user by test_tools_isolation.py::test_as_ordinary_user."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import isolation_support
import pytest
from isolation_support import run_code

from rlstages.engines.tools import isolation, jail
from rlstages.engines.tools.sandbox import PythonSandbox

backend = isolation_support.backend  # the fixture: each case against bubblewrap and the launcher


def test_missing_layer_refuses_the_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No bwrap: `auto` falls back to the launcher; where the kernel refuses the launcher a step (here
    pivot_root, made to fail), or bwrap is named and missing, the call is refused in one line, nothing runs."""
    isolation.probe.cache_clear()
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on this PATH
    try:
        fallback = run_code("print('ran')", isolation_backend="auto")
        isolation.probe.cache_clear()
        named = run_code("print('ran')", isolation_backend="bwrap")
        monkeypatch.setitem(jail._PIVOT_ROOT, os.uname().machine, -1)
        isolation.probe.cache_clear()
        neither = run_code("print('ran')", isolation_backend="auto")
        result = asyncio.run(PythonSandbox(timeout_s=30.0).call({"code": "print('ran')"}))
    finally:
        isolation.probe.cache_clear()
    assert fallback.output == "ran\n" and fallback.isolated and fallback.error is None, fallback
    assert named.output == "" and named.error == (
        "isolation required but unavailable: bwrap not found (install Debian's bubblewrap: apt-get install -y "
        "bubblewrap)"
    )
    assert neither.output == "" and neither.error.startswith(
        "isolation required but unavailable: bwrap not found (install Debian's bubblewrap: apt-get install -y "
        "bubblewrap) and launcher refused the sandbox (sandbox setup failed: pivot_root: "
    ), neither
    assert "\n" not in neither.error
    assert result.error == neither.error and result.text == f"Error: {neither.error}"
    opted_out = run_code("print('ran')", require_isolation=False)
    assert opted_out.output == "ran\n" and not opted_out.isolated


def test_preflight_reports_layers_refuses_a_missing_one_and_an_opt_out_is_recorded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from rlstages.configs import flatten, load_config
    from rlstages.engines.tools.registry import isolation_label
    from rlstages.tasks.driver.preflight import PreflightError, check_tool_isolation

    tiny = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
    tools = "rollout.multi_turn={enabled: true, environment: {tools: [{name: python%s}]}}"
    default = load_config(tiny, [tools % ""])
    opted_out = load_config(tiny, [tools % ", kwargs: {require_isolation: false}"])
    (report,) = check_tool_isolation(default)
    assert report.startswith("python tool isolation on this machine: file system: bubblewrap"), report
    assert "seccomp: libseccomp" in report and "identity: uid 65534, no_new_privs" in report
    (note,) = check_tool_isolation(opted_out)
    assert note.startswith("rollout.multi_turn.environment.tools.0.kwargs.require_isolation=false: ")
    # recorded: the MLflow params are the flattened config; the trajectory table gets a `sandbox` column
    assert (
        flatten(opted_out.model_dump(mode="json"))["rollout.multi_turn.environment.tools.0.kwargs.require_isolation"]
        == "False"
    )
    assert isolation_label(opted_out.rollout.multi_turn.environment) == "UNISOLATED (require_isolation: false)"
    assert isolation_label(default.rollout.multi_turn.environment) == "isolated"
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(jail._PIVOT_ROOT, os.uname().machine, -1)  # nor the launcher
    with pytest.raises(
        PreflightError,
        match=r"^rollout\.multi_turn\.environment\.tools\.0\.kwargs\.require_isolation: "
        r"this machine cannot isolate the python tool: bwrap not found",
    ) as err:
        check_tool_isolation(default)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="require_isolation: expected true or false, got 'no'"):
        PythonSandbox(require_isolation="no")


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="runs from a venv")
def test_default_interpreter_is_the_base_one_and_a_named_venv_runs_as_itself(backend: str) -> None:
    code = "import sys\nprint(sys.prefix)"
    assert run_code(code).output == f"{os.path.realpath(sys.base_prefix)}\n"
    assert run_code(code, python=sys.executable).output == f"{sys.prefix}\n"
