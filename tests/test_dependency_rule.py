"""The layering of design §1, enforced on the source: flows -> tasks -> engines -> configs.

engines never import prefect or mlflow; flows and tasks never import vllm, sglang, deepspeed or megatron;
configs import nothing of ours; only tasks/tracking.py imports mlflow. CPU only, no imports executed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = {"vllm", "sglang", "deepspeed", "megatron"}
RULES = {
    "configs": {"flows", "tasks", "engines", "prefect", "mlflow", "ray", "torch"} | BACKENDS,
    "engines": {"flows", "tasks", "prefect", "mlflow"},
    "tasks": {"flows"} | BACKENDS,
    "flows": BACKENDS,
}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(RULES))
def test_layering(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    offenders = {str(f.relative_to(ROOT)): sorted(imported_roots(f) & RULES[package]) for f in files}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"{package}/ breaks the dependency rule: {offenders}"


def test_only_tracking_imports_mlflow() -> None:
    users = [
        str(f.relative_to(ROOT)) for pkg in RULES for f in (ROOT / pkg).rglob("*.py") if "mlflow" in imported_roots(f)
    ]
    assert users == ["tasks/tracking.py"]


def test_rule_checker_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text("import prefect\nfrom mlflow import log_metric\nfrom .local import y\n")
    assert imported_roots(bad) == {"prefect", "mlflow"}
