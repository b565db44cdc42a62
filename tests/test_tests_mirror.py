"""tests/ mirrors the package's folders, so a module's tests are found by its path: every folder of test modules
under tests/configs, tests/engines, tests/tasks or tests/flows names a package folder (tests/engines/rollout/ ->
engines/rollout/); the other folders of tests/ are the tiers (cluster, gpu, integration) and data (assets). Test
module names stay unique across tests/ (pytest imports them by their base name: no __init__.py here).
CPU only, instant.
Run: pytest tests/test_tests_mirror.py
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
MIRRORS = ("configs", "engines", "tasks", "flows")
TIERS = {"cluster", "gpu", "integration", "assets"}


def stray_folders(tests: Path, root: Path) -> list[str]:
    """The folders of test modules under the mirrored roots that name no package folder (empty when all do)."""
    return sorted(
        str(d.relative_to(tests))
        for top in MIRRORS
        for d in {p.parent for p in (tests / top).rglob("test_*.py")}
        if not (root / d.relative_to(tests) / "__init__.py").is_file()
    )


def test_every_test_folder_names_a_package_folder() -> None:
    stray = stray_folders(TESTS, ROOT)
    assert not stray, f"test folders that mirror no package folder (move them, or name the folder as it): {stray}"


def test_top_level_folders_are_mirrors_or_tiers() -> None:
    tops = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert tops - TIERS <= set(MIRRORS), sorted(tops - TIERS - set(MIRRORS))


def test_the_engines_tests_are_sorted_into_their_folders() -> None:
    """A test of an engines subpackage lives in its folder: tests/engines/ itself holds only the tests of the modules
    at engines/'s top (registry, base's Protocols, compiled, tensordict_import)."""
    top = sorted(p.name for p in (TESTS / "engines").glob("test_*.py"))
    assert top == ["test_compiled.py", "test_protocols.py", "test_registry.py", "test_tensordict_import.py"], top


def test_test_module_names_are_unique() -> None:
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name not in {"conftest.py", "__init__.py"})
    assert not [n for n, c in names.items() if c > 1], [n for n, c in names.items() if c > 1]


def test_the_check_catches_a_stray_folder(tmp_path: Path) -> None:
    (tmp_path / "tests" / "engines" / "nowhere").mkdir(parents=True)
    (tmp_path / "tests" / "engines" / "nowhere" / "test_x.py").write_text("")
    (tmp_path / "engines" / "rollout").mkdir(parents=True)
    (tmp_path / "engines" / "__init__.py").write_text("")
    (tmp_path / "engines" / "rollout" / "__init__.py").write_text("")
    (tmp_path / "tests" / "engines" / "rollout").mkdir()
    (tmp_path / "tests" / "engines" / "rollout" / "test_y.py").write_text("")
    assert stray_folders(tmp_path / "tests", tmp_path) == ["engines/nowhere"]
