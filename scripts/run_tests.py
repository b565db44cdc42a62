"""`make test`: the suite in three tiers, then one report (tests/README.md).

1. parallel: every test not marked `serial`, in WORKERS pytest-xdist workers (`--dist loadgroup`: a module whose
   tests share a module-scoped fixture, or an explicit `xdist_group`, stays on one worker; the rest is
   load-balanced);
2. integration: the `integration` tests (all `serial`) in WORKERS workers: their two groups, the simulated cluster
   (`sim-cluster`) and the servers (`servers`: browser, deployments, prefect.yaml, doctor), side by side;
3. serial: the other `serial` tests, which must own the machine (timings, the SIGKILL drill), one at a time.

Every tier gets RLSTAGES_TEST_SHARED, a directory created here and removed at the end: the session fixtures that
build something costly (the tiny models, the reference run: tests/session_cache.py) build it there once, and the
later tiers read what the parallel tier built.

Tiers 2 and 3 collect only the files of the tests tier 1 left out (tests/conftest.py `pytest_deselected` lists them),
not the whole tree again (~20 s of a core a process). Every tier always runs. The report at the end lists the 25
slowest tests of all, the tests outside `slow` / `integration` over the 90 s budget (a list, not a failure), the wall
time, and one summary line, last. The exit status is non-zero if any tier failed or, run without arguments (as `make
test` does), selected no test (pytest's 5: a tier of the whole suite that runs nothing is a broken selection, not a
pass). Extra arguments go to every pytest run, e.g. `python scripts/run_tests.py -x tests/flows` (there a tier may
select nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = os.environ.get("RLSTAGES_TEST_WORKERS", "2")
BUDGET_S = 90.0
DURATIONS_FILE = ".test-durations.json"  # every test's seconds from the last `make test` (git-ignored)
# A test that hangs fails after this many seconds (pytest-timeout) instead of holding its tier until CI's limit;
# a test's own `pytest.mark.timeout` (the simulated cluster's) wins.
TIMEOUT = ["--timeout", os.environ.get("RLSTAGES_TEST_TIMEOUT", "900")]
PAIRED = ["-n", WORKERS, "--dist", "loadgroup"]
TIERS = [
    ("parallel", [*PAIRED, *TIMEOUT, "-m", "not serial and not gpu and not slow"]),
    # the integration tests' two xdist groups side by side: the simulated cluster on one worker, the servers
    # (browser, deployments, prefect.yaml, doctor) on the other; each waits mostly on its own processes
    ("integration", [*PAIRED, *TIMEOUT, "-m", "serial and integration and not gpu and not slow"]),
    ("serial", [*TIMEOUT, "-m", "serial and not integration and not gpu and not slow"]),
]


def say(line: str) -> None:
    """One line of the report on stdout, flushed (pytest's own output interleaves)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_tier(name: str, args: list[str], extra: list[str], record: Path, shared: Path) -> tuple[int, float]:
    """One pytest run; returns its exit status and wall seconds."""
    cmd = [sys.executable, "-m", "pytest", "-q", *args, *extra]
    say(f"\n=== tier {name}: {' '.join(cmd[1:])}")
    start = time.monotonic()
    env = {**os.environ, "RLSTAGES_TEST_RECORD": str(record), "RLSTAGES_TEST_SHARED": str(shared)}
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    return rc, time.monotonic() - start


def left_out_files(record: Path) -> list[str]:
    """The test files holding the tests a tier deselected (tests/conftest.py `pytest_deselected` writes them beside
    its record); empty (collect the whole tree) where it wrote none."""
    listed = record.with_name(record.name + ".deselected")
    if not listed.is_file():
        return []
    return sorted({line.strip() for line in listed.read_text().splitlines() if line.strip()})


def main(extra: list[str]) -> int:
    """Run every tier, print the combined report, return the exit status."""
    start = time.monotonic()
    results: list[tuple[str, int, float]] = []
    with tempfile.TemporaryDirectory(prefix="rlstages-test-record-") as tmp:
        records: list[dict] = []
        shared = Path(tmp) / "shared"  # the tiny models and the reference run, built once for every tier
        later: list[str] = []  # the files of the tests the parallel tier left out: all the later tiers collect
        for name, args in TIERS:
            record = Path(tmp) / f"{name}.jsonl"
            rc, seconds = run_tier(name, args, extra or later, record, shared)
            if name == "parallel":
                later = left_out_files(record)
            results.append((name, rc, seconds))
            if record.is_file():
                records += [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    wall = time.monotonic() - start
    durations: dict[str, float] = {}
    exempt: set[str] = set()
    counts: dict[str, int] = {}
    for entry in records:
        durations.update(entry["durations"])
        exempt.update(entry["exempt"])
        for key, n in entry["counts"].items():
            counts[key] = counts.get(key, 0) + n
    (ROOT / DURATIONS_FILE).write_text(json.dumps(dict(sorted(durations.items())), indent=0))  # every test's time
    say("\n" + "=" * 30 + " slowest 25 tests (all tiers; setup + call + teardown) " + "=" * 30)
    for nodeid, seconds in sorted(durations.items(), key=lambda kv: kv[1], reverse=True)[:25]:
        say(f"{seconds:8.2f}s {nodeid}")
    over = [(k, d) for k, d in durations.items() if d > BUDGET_S and k not in exempt]
    if over:
        say(f"-- over the {BUDGET_S:.0f} s budget outside slow/integration (a report, not a failure):")
        for nodeid, seconds in sorted(over, key=lambda kv: kv[1], reverse=True):
            say(f"{seconds:8.1f}s {nodeid}")
    failed = []
    for name, rc, seconds in results:
        say(f"tier {name}: exit {rc}, {seconds:.0f} s")
        if rc == 5 and extra:  # a selection of one's own (paths, -k) may hold no test of this tier
            say(f"tier {name} selected none of the tests given")
        elif rc == 5:
            say(f"tier {name} selected no test: the markers are wrong (the whole suite must fill every tier)")
            failed.append(name)
        elif rc != 0:
            failed.append(name)
    say(f"wall time: {wall:.0f} s ({wall / 60:.1f} min)")
    order = ["failed", "passed", "skipped", "xfailed", "xpassed", "error"]
    parts = [f"{counts[k]} {k}" for k in order if counts.get(k)]
    status = f"FAILED tiers: {', '.join(failed)}" if failed else "OK"
    say(f"===== {', '.join(parts) or 'no tests ran'} in {wall:.2f}s ({status}) =====")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
