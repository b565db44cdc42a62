"""Run a command and report its wall time and the peak PSS summed over it and all its descendants (Ray's
workers included), sampled every second (reading smaps costs CPU): how the demo's peak memory is measured.

    python -m bench.pss -- rlstages run configs/demo.yaml cluster.heap=bounded
"""

from __future__ import annotations

import subprocess
import sys
import time

from bench.common import PssSampler


def main() -> None:
    """Run argv after `--`; print wall seconds and peak PSS; exit with the command's code."""
    argv = sys.argv[1:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m bench.pss -- COMMAND [ARGS...]")
    start = time.perf_counter()
    proc = subprocess.Popen(argv)
    with PssSampler(proc.pid) as pss:
        code = proc.wait()
    wall, peak = time.perf_counter() - start, pss.peak / 1e9
    print(f"wall {wall:.1f} s, peak PSS {peak:.2f} GB (process tree) at {pss.peak_at:.0f} s", flush=True)
    for size, title in pss.peak_breakdown:  # where the peak sat, every process of 10 MB or more
        if size >= 10e6:
            print(f"  {size / 1e9:6.2f} GB  {title}", flush=True)
    print("PSS over the run (tree / largest process, GB): " + _profile(pss.series, wall), flush=True)
    sys.exit(code)


def _profile(series: list[tuple[float, int, int]], wall: float, parts: int = 10) -> str:
    """The highest sample of each tenth of the run: whether the peak is a moment or a plateau."""
    out = []
    for i in range(parts):
        lo, hi = wall * i / parts, wall * (i + 1) / parts
        inside = [(tree, top) for t, tree, top in series if lo <= t < hi]
        if inside:
            tree, top = max(inside)
            out.append(f"{hi:.0f}s {tree / 1e9:.2f}/{top / 1e9:.2f}")
    return ", ".join(out)


if __name__ == "__main__":
    main()
