"""A Ray we start is closed: token authentication on (a 0600 token file is created), every server of its process
tree listens on 127.0.0.1, and a client with a wrong token is refused; no idle worker is started ahead of need
(`NO_PRESTART`); no autoscaler monitor and no dashboard process start (`lean_head`), the log monitor does. Real Ray
in a subprocess (~12 s)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import json, os, subprocess, sys
import psutil, ray
from rlstages.tasks.driver.ray_auth import init_local_ray
init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
me = psutil.Process()
import time; time.sleep(5)  # Ray's prestart, where on, has begun by now
idle = [p.pid for p in me.children(recursive=True) if p.name() == "ray::IDLE"]  # 2 with Ray's prestart

@ray.remote
def probe():
    return os.environ.get("RAY_AUTH_MODE"), ray.util.get_node_ip_address()

mode, ip = ray.get(probe.remote())
children = me.children(recursive=True)
tree = {me.pid} | {p.pid for p in children}
commands = [" ".join(p.cmdline()) for p in children]
listening = sorted({c.laddr.ip for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.pid in tree})
address = ray.get_runtime_context().gcs_address
env = {**os.environ, "RAY_AUTH_TOKEN": "0" * 64, "RAY_AUTH_MODE": "token"}
env["RAY_NUM_REDIS_GET_RETRIES"] = "2"  # refused at once, not after Ray's 20 one-second retries
env.pop("RAY_AUTH_TOKEN_PATH", None)
intruder = subprocess.run(
    [sys.executable, "-c", f"import ray; ray.init(address={address!r}); print('CONNECTED')"],
    capture_output=True, text=True, timeout=120, env=env,
)
tail = intruder.stdout + intruder.stderr
print(json.dumps({"mode": mode, "ip": ip, "listening": listening, "intruder": tail, "idle": idle,
                  "commands": commands}))
ray.shutdown()
"""


def test_local_ray_has_token_auth_and_listens_on_loopback_only(tmp_path: Path) -> None:
    token = tmp_path / "ray" / "auth_token"
    env = {k: v for k, v in os.environ.items() if k not in {"RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}}
    env["RAY_AUTH_TOKEN_PATH"] = str(token)
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["mode"] == "token" and report["ip"] == "127.0.0.1"
    assert report["listening"] and all(ip in {"127.0.0.1", "::ffff:127.0.0.1"} for ip in report["listening"]), report
    assert "CONNECTED" not in report["intruder"] and "auth" in report["intruder"].lower(), report["intruder"]
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    assert report["idle"] == [], f"worker processes started before any task or actor: {report['idle']}"
    started = "\n".join(report["commands"])
    assert "gcs_server" in started and "log_monitor.py" in started, started  # the commands were read
    assert "autoscaler/_private/monitor.py" not in started and "dashboard/dashboard.py" not in started, started


def test_lean_head_skips_the_dashboard_only_when_told_and_puts_the_node_back() -> None:
    from ray._private.node import Node

    from rlstages.tasks.driver.lean_head import lean_head

    monitor, api_server = Node.start_monitor, Node.start_api_server
    with lean_head(None) as lean:  # Ray's default: it tries the dashboard; the monitor is skipped all the same
        assert lean and Node.start_monitor is not monitor and Node.start_api_server is api_server
    with lean_head(False):
        assert Node.start_monitor is not monitor and Node.start_api_server is not api_server
    assert Node.start_monitor is monitor and Node.start_api_server is api_server
