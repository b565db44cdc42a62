"""`rlstages doctor` finds the vLLM environment where the rollout's actors find it (beside the repository, or
beside the running interpreter's venv when installed from a wheel), not inside the package. CPU only, ~2 s.
Run: pytest tests/flows/test_doctor.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from rlstages.engines.rollout import vllm_rollout
from rlstages.flows.cli import doctor


def fake_venv(root: Path) -> Path:
    """A `.venv-vllm` whose interpreter is this one (it has no vllm: the probe fails, naming the interpreter)."""
    python = root / ".venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    os.symlink(sys.executable, python)
    return python


def test_doctor_probes_the_interpreter_the_rollout_would_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = fake_venv(tmp_path / "checkout")
    monkeypatch.setattr(vllm_rollout, "DEFAULT_VLLM_VENV", python.parent.parent)
    assert vllm_rollout.vllm_actor_options()["runtime_env"]["py_executable"] == str(python)
    found = doctor.vllm_interpreter(None)
    assert found == python
    row = doctor._vllm_row({"vllm-venv": doctor._import_probe(str(found), "vllm", 60)}, found, 0)
    assert row.ok is False and str(python) in row.detail and "import vllm failed" in row.detail


def test_a_wheel_install_finds_the_venv_beside_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed from a wheel there is no repository: `<project>/.venv-vllm` beside `<project>/.venv` is used."""
    monkeypatch.setattr(vllm_rollout, "DEFAULT_VLLM_VENV", tmp_path / "site-packages" / ".venv-vllm")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "project" / ".venv"))
    assert doctor.vllm_interpreter(None) is None
    row = doctor._vllm_row({}, None, 0)
    assert row.ok is False and str(tmp_path / "project" / ".venv-vllm") in row.detail  # says where it looked
    python = fake_venv(tmp_path / "project")
    assert doctor.vllm_interpreter(None) == python
    assert vllm_rollout.vllm_actor_options()["runtime_env"]["py_executable"] == str(python)
    assert doctor.vllm_interpreter(tmp_path / "mine") == tmp_path / "mine"  # --vllm-python wins
