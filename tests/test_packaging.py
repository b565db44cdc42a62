"""The distribution installs one import name, `rlstages`: the repository's four folders become
`rlstages.configs`, `rlstages.engines`, `rlstages.tasks`, `rlstages.flows`, and nothing named `configs`,
`tasks`, `engines` or `flows` lands in site-packages. Builds a wheel (no network, no dependencies), installs
it into a fresh venv and imports from outside the checkout. CPU only; ~30 s.
Run: pytest tests/test_packaging.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("configs", "engines", "tasks", "flows")


def declared_packages() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def test_package_list_matches_the_tree() -> None:
    """Every folder with an __init__.py under the four roots is listed in pyproject (and nothing else)."""
    on_disk = sorted(
        "rlstages." + ".".join(p.parent.relative_to(ROOT).parts)
        for d in FOLDERS
        for p in (ROOT / d).rglob("__init__.py")
    )
    assert sorted(declared_packages()) == on_disk


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel and the build's verbose output (setuptools' banners show only with -v)."""
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in tracked:  # build from a copy: setuptools writes build/ and *.egg-info beside the sources
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        text=True,
        cwd=out,
    )
    (found,) = out.glob("rlstages-*.whl")
    return found, done.stdout + done.stderr


@pytest.fixture(scope="module")
def wheel(built: tuple[Path, str]) -> Path:
    return built[0]


def test_build_prints_no_deprecation_and_declares_an_spdx_license(built: tuple[Path, str]) -> None:
    """`pip install` shows a newcomer no setuptools banner: the license is an SPDX string (PEP 639), not a table."""
    wheel, output = built
    assert "deprecat" not in output.lower(), [line for line in output.splitlines() if "eprecat" in line]
    metadata = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))
    assert "License-Expression: Apache-2.0" in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()


def test_wheel_has_one_top_level_name(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"rlstages"}
    for folder in FOLDERS:
        assert f"rlstages/{folder}/__init__.py" in names
    assert "rlstages/configs/demo.yaml" in names  # presets ship as package data
    assert "rlstages/configs/published_models.json" in names  # the memory plan's model sizes
    assert "rlstages/configs/agentic_multiply_train.jsonl" in names  # a preset's sample data beside it
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "rlstages = rlstages.flows.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_installed_wheel_imports_only_as_rlstages(wheel: Path, tmp_path: Path) -> None:
    """A fresh venv with the wheel (dependencies borrowed from this interpreter's site-packages through a .pth,
    which does not run this checkout's editable finder): `import rlstages.configs` works, `import configs` fails."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)], check=True
    )
    code = (
        "import rlstages.configs, rlstages.engines.registry, rlstages.flows.cli.main\n"
        "print(rlstages.configs.__file__)\n"
        "import importlib.util as u\n"
        "print([n for n in ('configs', 'engines', 'tasks', 'flows') if u.find_spec(n) is not None])\n"
    )
    done = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = done.stdout.strip().splitlines()[-2:]
    assert first.startswith(str(site)), first
    assert second == "[]"
