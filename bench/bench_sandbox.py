"""The `python` tool's call, isolated (bubblewrap, or the fallback launcher) and not (`require_isolation:
false`), against a bare interpreter started by asyncio in the same run: what isolation adds to a call.
Informative (no goal); the seconds are printed too (the issue's budget: a call under 0.6 s).
`python -m bench.bench_sandbox`"""

from __future__ import annotations

import asyncio
import sys
import tempfile

from bench.common import best_of, record, report
from rlstages.engines.tools.isolation import interpreter
from rlstages.engines.tools.sandbox_run import SandboxLimits, run_python

CODE = "import math\nopen('notes.txt', 'w').write(str(math.pi))\nprint(open('notes.txt').read())"


async def _bare(cwd: str) -> None:
    python = interpreter(None)[0]
    proc = await asyncio.create_subprocess_exec(python, "-I", "-c", CODE, stdout=asyncio.subprocess.PIPE, cwd=cwd)
    await proc.communicate()


def _call(limits: SandboxLimits) -> None:
    run = asyncio.run(run_python(CODE, limits))
    if run.error is not None:
        raise SystemExit(f"bench_sandbox: the call failed: {run.error}: {run.output[-200:]}")


def main() -> None:
    """Median of 5 calls after a warm-up, each kind."""
    with tempfile.TemporaryDirectory() as cwd:
        base = best_of(lambda: asyncio.run(_bare(cwd)), repeat=5)
    isolated = best_of(lambda: _call(SandboxLimits(timeout_s=30.0)), repeat=5)
    fallback = best_of(lambda: _call(SandboxLimits(timeout_s=30.0, isolation_backend="launcher")), repeat=5)
    launcher = best_of(lambda: _call(SandboxLimits(timeout_s=30.0, require_isolation=False)), repeat=5)
    record("sandbox_call_isolated", isolated / base, None, f"{isolated:.3f} s a call, bare interpreter {base:.3f} s")
    record("sandbox_call_jail", fallback / base, None, f"{fallback:.3f} s a call (the fallback launcher, jail.py)")
    record("sandbox_call_unisolated", launcher / base, None, f"{launcher:.3f} s a call (launcher, two interpreters)")
    report(
        "python tool call vs a bare interpreter (ratio = ours / baseline)",
        [
            ("isolated, bubblewrap (default)", isolated, base, "-"),
            ("isolated, fallback launcher", fallback, base, "-"),
            ("require_isolation: false", launcher, base, "-"),
        ],
    )
    print(f"python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
