"""The annotated file tree (docs/architecture.md, linked from the README) names files and folders that exist, and
names every module of flows/, tasks/ and tasks/driver/ and every subpackage of engines/ (so a new module shows up in
the tree).
CPU only, instant.
Run: pytest tests/test_readme_tree.py
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


TREE_DOC = ROOT / "docs" / "architecture.md"


def tree_block() -> str:
    text = TREE_DOC.read_text()
    start = text.index("```\nflows/\n")
    return text[start + 4 : text.index("```", start + 4)]


def named_paths() -> set[str]:
    """`folder/name` for each entry of the tree (an indented name under a top-level folder)."""
    paths: set[str] = set()
    top = ""
    for line in tree_block().splitlines():
        if m := re.match(r"^(\S+/|\S+)\s", line + " "):
            top = m.group(1).rstrip("/")
            paths.add(top)
        elif m := re.match(r"^  (\S+)", line):
            paths.add(f"{top}/{m.group(1).rstrip('/')}")
    return paths


def test_every_entry_exists() -> None:
    missing = sorted(p for p in named_paths() if not (ROOT / p).exists())
    assert not missing, f"{TREE_DOC.name}'s tree names what does not exist: {missing}"


def test_every_module_and_subpackage_is_named() -> None:
    named = named_paths()
    wanted = {f"{d}/{p.name}" for d in ("flows", "tasks") for p in (ROOT / d).glob("*.py") if p.name != "__init__.py"}
    wanted |= {
        f"{d}/{p.name}"
        for d in ("flows", "tasks", "engines")
        for p in (ROOT / d).iterdir()
        if (p / "__init__.py").is_file()
    }
    wanted |= {f"engines/{p.name}" for p in (ROOT / "engines").glob("*.py") if p.name != "__init__.py"}
    assert not sorted(wanted - named), f"{TREE_DOC.name}'s tree does not name: {sorted(wanted - named)}"


def test_the_readme_links_the_tree_and_stays_short() -> None:
    """A newcomer's README: at most ~250 lines, the two commands, and the way to the tree."""
    readme = (ROOT / "README.md").read_text()
    assert "(docs/architecture.md)" in readme
    assert "make demo   #" in readme and "make test   #" in readme
    assert len(readme.splitlines()) <= 250


def test_every_driver_module_is_named() -> None:
    """tasks/driver/ is one entry of the tree; its modules and subpackages are named in its description."""
    block = tree_block()
    driver = ROOT / "tasks" / "driver"
    names = {p.name for p in driver.glob("*.py") if p.name != "__init__.py"}
    names |= {f"{p.name}/" for p in driver.iterdir() if (p / "__init__.py").is_file()}
    assert names, "tasks/driver/ has no modules"
    unnamed = sorted(n for n in names if n not in block)
    assert not unnamed, f"{TREE_DOC.name}'s tree does not name these of tasks/driver/: {unnamed}"
