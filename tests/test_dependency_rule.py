"""The layering of design §1, enforced on the source: flows -> tasks -> tasks.driver -> engines -> configs.

tasks/ holds the Prefect stage tasks; tasks/driver/ the driver's Prefect-free services below them (never
importing prefect, nor a stage module); engines never import prefect or mlflow; flows and tasks never import
vllm, sglang, deepspeed or megatron; configs import nothing of ours; only the tasks/driver/tracking/ package
imports mlflow; inside engines/ imports flow one way
(no cycle between modules, lazy imports inside functions included) and downward through the layers of
`ENGINE_LAYERS`, with no exception. Imports made by name count as imports:
`importlib.import_module("a.b")` / `import_module("a.b")` / `__import__("a.b")` with a literal; a registry's
"package.module:attr" string is checked against the package rules (engines never name a task) but is no edge
of the file that holds it (a table imports nothing: whoever resolves the string does, through
`engines.imports.import_object`). CPU only, no imports executed.
Run: pytest tests/test_dependency_rule.py
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("configs", "engines", "tasks", "flows")
BACKENDS = {"vllm", "sglang", "deepspeed", "megatron"}
RULES = {  # layer -> what it must not import (a layer is a package, or tasks.driver inside tasks)
    "configs": {"flows", "tasks", "tasks.driver", "engines", "prefect", "mlflow", "ray", "torch"} | BACKENDS,
    "engines": {"flows", "tasks", "tasks.driver", "prefect", "mlflow"},
    "tasks.driver": {"flows", "tasks", "prefect"} | BACKENDS,
    "tasks": {"flows"} | BACKENDS,
    "flows": BACKENDS,
}
TRACKING = "tasks/driver/tracking"  # the only MLflow user


BY_NAME = {"import_module", "__import__"}  # importlib.import_module("x"), import_module("x"), __import__("x")
TARGET = re.compile(r"(rlstages(?:\.\w+)+):[\w.]+")  # a registry's "package.module:attr"


def imported_modules(path: Path) -> set[str]:
    """Every absolute module a file imports (module level and inside functions), by statement or by name
    (`import_module` / `__import__` with a string literal); `from a import b` gives `a.b` when `b` is a
    submodule on disk, else `a`."""
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
        elif isinstance(node, ast.Call) and node.args and _called_name(node.func) in BY_NAME:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and not first.value.startswith("."):
                names.add(first.value)
    return names


def _called_name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def named_targets(path: Path) -> set[str]:
    """The modules of the "rlstages.package.module:attr" string literals in a file (registry entries)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        m.group(1)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := TARGET.fullmatch(node.value))
    }


def layer(module: str) -> str:
    """The layer (or third-party root) a module belongs to: `rlstages.engines.x` -> `engines`,
    `rlstages.tasks.driver.x` -> `tasks.driver`."""
    parts = module.split(".")
    if parts[:3] == ["rlstages", "tasks", "driver"]:
        return "tasks.driver"
    return parts[1] if parts[0] == "rlstages" and len(parts) > 1 else parts[0]


def layer_files(name: str) -> list[Path]:
    """The sources of one layer of `RULES` (tasks/ without tasks/driver/)."""
    files = sorted((ROOT / name.replace(".", "/")).rglob("*.py"))
    return [f for f in files if layer(module_name(f)) == name]


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
    files = layer_files(package)
    assert files, f"no sources in layer {package}"
    offenders = {
        str(f.relative_to(ROOT)): sorted({layer(m) for m in imported_modules(f) | named_targets(f)} & RULES[package])
        for f in files
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
    users = sorted(
        str(f.relative_to(ROOT))
        for pkg in PACKAGES
        for f in (ROOT / pkg).rglob("*.py")
        if "mlflow" in {layer(m) for m in imported_modules(f)}
    )
    assert users, "no module imports mlflow: the tracking package moved (update TRACKING)"
    assert all(u.startswith(TRACKING + "/") for u in users), f"mlflow imported outside {TRACKING}/: {users}"


def test_tasks_holds_the_stages_only() -> None:
    """A module directly in tasks/ is Prefect's (a stage, or the stages' policies and worker-call helper); a
    Prefect-free driver service belongs in tasks/driver/."""
    prefect_free = [
        str(f.relative_to(ROOT))
        for f in layer_files("tasks")
        if f.name != "__init__.py"
        and not {layer(m) for m in imported_modules(f)} & {"prefect"}
        and "rlstages.tasks.policies" not in imported_modules(f)
    ]
    assert not prefect_free, f"Prefect-free modules in tasks/ (move them to tasks/driver/): {prefect_free}"


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (a package's __init__ is its own node)."""
    graph: dict[str, set[str]] = {}
    for f in sorted((ROOT / package).rglob("*.py")):
        deps = {m for m in imported_modules(f) if m.split(".")[1:2] == [package] and module_file(m) is not None}
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
    assert layer("rlstages.tasks.driver.preflight") == "tasks.driver" and layer("rlstages.tasks.rollout") == "tasks"
    assert layer_files("tasks") and not any("driver" in f.relative_to(ROOT).parts for f in layer_files("tasks"))


def test_imports_by_name_are_seen(tmp_path: Path) -> None:
    """A literal `import_module` is an import (the hidden cycle between convert.templates and moe_templates was
    one); a computed name is not knowable; a registry string names the module for the package rules only."""
    src = tmp_path / "x.py"
    src.write_text(
        "import importlib\nfrom importlib import import_module\n"
        "importlib.import_module('rlstages.tasks.a')\nimport_module('rlstages.flows.b')\n__import__('prefect')\n"
        "importlib.import_module(name)\nimportlib.import_module('.rel', 'pkg')\n"
        "TABLE = {'x': 'rlstages.tasks.c:Thing', 'doc': 'see rlstages.tasks.d:E for more'}\n"
    )
    assert imported_modules(src) == {"importlib", "rlstages.tasks.a", "rlstages.flows.b", "prefect"}
    assert named_targets(src) == {"rlstages.tasks.c"}
    cycle = {"rlstages.engines.p": {"rlstages.engines.q"}, "rlstages.engines.q": {"rlstages.engines.p"}}
    assert find_cycle(cycle) == ["rlstages.engines.p", "rlstages.engines.q", "rlstages.engines.p"]


# ---- the layers inside engines/ ------------------------------------------------------------------------------
# Lowest first, as engines/README.md's table says them (read here, so the picture and the rule are one text): a
# module may import its own layer and those below. Names are relative to `rlstages.engines`; a module belongs to
# the longest name that prefixes it ("runtime.device" -> "runtime").
ENGINES_README = ROOT / "engines" / "README.md"


def engine_layers(text: str) -> tuple[tuple[str, ...], ...]:
    """The `packages` column of each row of the README's layer table (`| N | `a`, `b` | what |`), in order."""
    rows = re.findall(r"^\| (\d+) \| (.+?) \|", text, flags=re.MULTILINE)
    assert [int(n) for n, _ in rows] == list(range(len(rows))), "engines/README.md: layers numbered 0, 1, ..."
    return tuple(
        tuple("" if name == "(package)" else name for name in re.findall(r"`([^`]+)`", packages))
        for _, packages in rows
    )


ENGINE_LAYERS: tuple[tuple[str, ...], ...] = engine_layers(ENGINES_README.read_text())


def engine_layer(module: str) -> int:
    """The index in `ENGINE_LAYERS` of an engines module (`rlstages.engines.runtime.device` -> 3)."""
    rel = module.removeprefix("rlstages.engines").removeprefix(".")
    best = max(
        (name for names in ENGINE_LAYERS for name in names if name == "" or rel == name or rel.startswith(name + ".")),
        key=len,
    )
    return next(i for i, names in enumerate(ENGINE_LAYERS) if best in names)


def upward_arrows(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported), relative to `rlstages.engines`, for each import into a higher layer."""
    rel = lambda m: m.removeprefix("rlstages.engines.")  # noqa: E731
    return {(rel(a), rel(b)) for a, deps in graph.items() for b in deps if engine_layer(b) > engine_layer(a)}


def test_engines_layer_order() -> None:
    graph = import_graph("engines")
    placed = {name.split(".")[0] for names in ENGINE_LAYERS for name in names if name}
    unplaced = sorted(m for m in graph if m != "rlstages.engines" and m.split(".")[2] not in placed)
    assert not unplaced, f"engines modules in no layer of ENGINE_LAYERS (add their package): {unplaced}"
    arrows = sorted(upward_arrows(graph))
    assert not arrows, f"imports up the engines' layers (ENGINE_LAYERS): {arrows}"


def test_layer_checker_catches_an_upward_import() -> None:
    graph = {"rlstages.engines.types": {"rlstages.engines.training.core"}, "rlstages.engines.rollout.x": set()}
    assert upward_arrows(graph) == {("types", "training.core")}
    assert engine_layer("rlstages.engines.runtime.device") == engine_layer("rlstages.engines.runtime") == 3
    assert engine_layer("rlstages.engines.sync.collective.wire") == 4
    assert engine_layer("rlstages.engines.workers.hybrid") > engine_layer("rlstages.engines.training.core")
    assert engine_layer("rlstages.engines") == 0
    assert upward_arrows({"rlstages.engines.runtime.device": {"rlstages.engines.workers.hybrid"}}) == {
        ("runtime.device", "workers.hybrid")
    }
