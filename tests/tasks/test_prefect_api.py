"""Prefect's temporary server started in the background (`rlstages run` starts its Ray meanwhile): the run's next
`start_temporary_server` waits for it, the server answers and has SIGINT blocked as a foreground start gives it;
a background start that failed is started again in the foreground, with a warning. A real temporary server in a
fresh process with no PREFECT_API_URL (~10 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import json, logging, signal, threading
from rlstages.tasks import prefect_api as P

def blocked(pid):
    mask = next(line for line in open(f"/proc/{pid}/status") if line.startswith("SigBlk:")).split()[1]
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))

P.start_temporary_server_in_background()
threads = [t.name for t in threading.enumerate()]
P.start_temporary_server()
server = P._temporary_server()
first = {"thread": "prefect-temporary-server" in threads, "answering": P.answering(),
         "sigint_blocked": blocked(server.server_process.pid), "left": len(P._starting)}
server.stop()

warnings = []
logging.getLogger("rlstages.prefect_api").addHandler(logging.Handler())
logging.getLogger("rlstages.prefect_api").handlers[-1].emit = lambda r: warnings.append(r.getMessage())
real, calls = P._start_now, []
def flaky():
    calls.append(threading.current_thread().name)
    if len(calls) == 1:
        raise OSError("port taken")
    real()
P._start_now = flaky
P.start_temporary_server_in_background()
P.start_temporary_server()
again = {"calls": calls, "answering": P.answering(), "warnings": warnings}
P._temporary_server().stop()
print(json.dumps({"first": first, "again": again}))
"""


def test_a_background_start_is_waited_for_shielded_from_ctrl_c_and_retried_where_it_failed(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["first"] == {"thread": True, "answering": True, "sigint_blocked": True, "left": 0}
    again = seen["again"]
    assert again["calls"] == ["prefect-temporary-server", "MainThread"] and again["answering"]
    assert any("did not start in the background (port taken); starting it now" in w for w in again["warnings"])
