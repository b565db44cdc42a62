"""`rlstages doctor` finds the vLLM environment where the rollout's actors find it (beside the repository, or
beside the running interpreter's venv when installed from a wheel), not inside the package. CPU only, ~2 s.
Run: pytest tests/flows/cli/test_doctor.py
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from rlstages.engines.rollout import vllm_rollout
from rlstages.flows.cli import demo_times
from rlstages.flows.cli import doctor_probes as doctor


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


XEON = "model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512vl\n"
EPYC = "model name\t: AMD EPYC 9B14\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
ZEN3 = "model name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma f16c\n"  # AVX2 + FMA, no AVX-512: issue 53's CPU


def test_the_cpu_class_comes_from_its_bf16_flags() -> None:
    from rlstages.engines.training.machine import bf16_flags, cpu_model

    assert cpu_model(XEON) == "Intel(R) Xeon(R) CPU @ 2.20GHz" and bf16_flags(XEON) == ()
    assert cpu_model(EPYC) == "AMD EPYC 9B14" and bf16_flags(EPYC) == ("avx512_bf16",)


def test_the_avx2_only_class_and_its_rollout_weights() -> None:
    """Three classes: native bf16, AVX-512 without bf16, AVX2 only; the rollout's weights are said with them."""
    from rlstages.engines.training.machine import Machine, bf16_flags, rollout_choice, simd_flags

    classes = [
        Machine("cpu", 2, bf16_flags(info), 2, "bf16", simd_flags(info)).cpu_class for info in (EPYC, XEON, ZEN3)
    ]
    assert classes == ["native-bf16", "avx512", "avx2"]
    zen3 = Machine("AMD EPYC", 2, (), 2, "fp32 kernel", simd_flags(ZEN3), rollout_choice(True, True, 2))
    assert "AVX2 only (no AVX-512)" in zen3.line() and "rollout fp32 copy of the bf16 weights" in zen3.line()
    assert zen3.tags()["machine.class"] == "avx2"
    assert rollout_choice(False, True, 2).startswith("bf16 weights") and rollout_choice(None, True, 2) == ""
    assert rollout_choice("auto", False, 2) == "fp32 weights (model in float32)"
    assert {row.key for row in demo_times.DEMO_ROWS} == {"native-bf16-amx", "native-bf16", "avx512", "avx2"}
    amx = Machine("Intel Xeon", 2, ("avx512_bf16", "amx_bf16"), 2, "bf16 (AMX)", ("avx512f", "avx2"))
    rows = [doctor.demo_class(m) for m in (amx, zen3, Machine("AMD EPYC", 2, ("avx512_bf16",), 2, "bf16"))]
    assert rows == ["native-bf16-amx", "avx2", "native-bf16"]  # AMX said apart: its demo is its own
    assert amx.cpu_class == "native-bf16"  # the class runs and presets are keyed by stays the same


def test_doctor_prints_this_machines_class_and_its_demo_time() -> None:
    from rlstages.engines.training.machine import bf16_flags, measure

    rows = {c.name: c.detail for c in doctor.machine()}
    native = bool(bf16_flags())
    assert rows["class"] == demo_times.class_times(doctor.demo_class(measure("auto", True, 2, "auto")))
    assert "measured on" in rows["class"] and "**" not in rows["class"], rows["class"]
    assert rows["native bf16"].startswith("yes" if native else "no")
    assert re.search(r"(bf16|fp32 kernel).*\(2 threads", rows["bf16 GEMM"]), rows


def test_the_readme_table_and_the_doctor_say_the_same_demo_times() -> None:
    """The README's "What to expect" table is `demo_times.DEMO_ROWS` rendered: one place for each class's figures."""
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    assert demo_times.readme_table() in readme, (
        "README.md: the demo-times table differs from flows/cli/demo_times.py's rows; paste the output of "
        "`python -m rlstages.flows.cli.demo_times` over it"
    )
    native = demo_times.class_times("native-bf16")
    assert "Zen 5" in native and "half-width" in native  # a class with two rows says both
    assert demo_times.class_times("riscv") == "riscv: no clean-clone demo measured yet"
