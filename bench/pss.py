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
    print(f"wall {time.perf_counter() - start:.1f} s, peak PSS {pss.peak / 1e9:.2f} GB (process tree)", flush=True)
    for size, title in pss.peak_breakdown[:8]:  # where the peak sat
        print(f"  {size / 1e9:6.2f} GB  {title}", flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
