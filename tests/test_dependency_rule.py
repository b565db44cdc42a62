"""The layering of design §1, enforced on the source: flows -> tasks -> engines -> configs.

engines never import prefect or mlflow; flows and tasks never import vllm, sglang, deepspeed or megatron;
configs import nothing of ours; only tasks/tracking.py imports mlflow; inside engines/ imports flow one way
(no cycle between modules, lazy imports inside functions included). CPU only, no imports executed.
Run: pytest tests/test_dependency_rule.py
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("configs", "engines", "tasks", "flows")
BACKENDS = {"vllm", "sglang", "deepspeed", "megatron"}
RULES = {
    "configs": {"flows", "tasks", "engines", "prefect", "mlflow", "ray", "torch"} | BACKENDS,
    "engines": {"flows", "tasks", "prefect", "mlflow"},
    "tasks": {"flows"} | BACKENDS,
    "flows": BACKENDS,
}


def imported_modules(path: Path) -> set[str]:
    """Every absolute module a file imports (module level and inside functions); `from a import b` gives
    `a.b` when `b` is a submodule on disk, else `a`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if module_file(sub) is not None:
                    names.add(sub)
    return names


def layer(module: str) -> str:
    """The layer (or third-party root) a module belongs to: `rlstages.engines.x` -> `engines`."""
    parts = module.split(".")
    return parts[1] if parts[0] == "rlstages" and len(parts) > 1 else parts[0]


def module_file(module: str) -> Path | None:
    """The source file of one of our modules (`rlstages.engines.types` -> engines/types.py), else None."""
    parts = module.split(".")
    if parts[0] != "rlstages" or len(parts) < 2 or parts[1] not in PACKAGES:
        return None
    base = ROOT.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(("rlstages", *parts))


@pytest.mark.parametrize("package", sorted(RULES))
def test_layering(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    offenders = {
        str(f.relative_to(ROOT)): sorted({layer(m) for m in imported_modules(f)} & RULES[package]) for f in files
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"{package}/ breaks the dependency rule: {offenders}"


def test_no_bare_top_level_imports() -> None:
    """Our code imports itself as `rlstages.*`: a bare `import engines` would only work from a checkout."""
    bare = {
        str(f.relative_to(ROOT)): sorted(m for m in imported_modules(f) if m.split(".")[0] in PACKAGES)
        for pkg in (*PACKAGES, "tests", "bench")
        for f in (ROOT / pkg).rglob("*.py")
    }
    assert not {k: v for k, v in bare.items() if v}


def test_only_tracking_imports_mlflow() -> None:
    users = [
        str(f.relative_to(ROOT))
        for pkg in RULES
        for f in (ROOT / pkg).rglob("*.py")
        if "mlflow" in {layer(m) for m in imported_modules(f)}
    ]
    assert users == ["tasks/tracking.py"]


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (a package's __init__ is its own node)."""
    graph: dict[str, set[str]] = {}
    for f in sorted((ROOT / package).rglob("*.py")):
        deps = {m for m in imported_modules(f) if layer(m) == package and module_file(m) is not None}
        graph[module_name(f)] = deps - {module_name(f)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    cycle = find_cycle(import_graph(package))
    assert cycle is None, f"import cycle in {package}/: {' -> '.join(cycle or [])}"


def test_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_rule_checker_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text(
        "import prefect\nfrom mlflow import log_metric\nfrom .local import y\nfrom rlstages.flows import z\n"
    )
    assert {layer(m) for m in imported_modules(bad)} == {"prefect", "mlflow", "flows"}
