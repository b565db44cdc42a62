"""`python -m bench.pss` (how the demo's peak memory is measured): the peak PSS of a command's whole process tree,
where it sat process by process, and the command's own exit code. A real command whose child holds 300 MB
(~4 s)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HOLDER = "import time; b = bytearray(300 * 2**20); time.sleep(3.5)"  # pages touched: bytearray zero-fills
PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {HOLDER!r}]); sys.exit(3)"


def test_the_peak_counts_descendants_names_them_and_keeps_the_exit_code() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.pss", "--", sys.executable, "-c", PARENT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 3, out.stderr[-2000:]
    peak = re.search(r"peak PSS ([\d.]+) GB \(process tree\)", out.stdout)
    assert peak and 0.3 <= float(peak.group(1)) < 1.0, out.stdout
    parts = re.findall(r"^\s+([\d.]+) GB  (.*)$", out.stdout, re.M)
    holder = [float(gb) for gb, title in parts if "bytearray" in title]
    assert holder and holder[0] >= 0.3, parts  # the child, named by its command line, at the peak
    assert float(peak.group(1)) >= sum(float(gb) for gb, _ in parts) - 0.005 * len(parts)  # each rounded
    assert re.search(r"PSS over the run \(tree / largest process, GB\): \d+s [\d.]+/[\d.]+", out.stdout)
