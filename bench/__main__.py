"""Run every benchmark: `python -m bench` (or `make bench`). Each prints ratios against a baseline measured
in the same run; none is a test."""

from __future__ import annotations

import importlib
import sys

BENCHES = [
    "bench.bench_rollout",
    "bench.bench_sync",
    "bench.bench_flow",
    "bench.bench_convert",
    "bench.bench_backends",
    "bench.bench_off_policy",
]


def main() -> None:
    """Run the benches named on the command line (default: all) in separate processes."""
    import subprocess

    names = sys.argv[1:] or BENCHES
    for name in names:
        if importlib.util.find_spec(name) is None:
            print(f"skip {name}: not present")
            continue
        print(f"== {name}")
        subprocess.run([sys.executable, "-m", name], check=False)


if __name__ == "__main__":
    main()
