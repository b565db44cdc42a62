"""`rlstages run` starts its own local Ray before the flow (while Prefect's temporary server starts): with the
user's plugins exported first, so the workers inherit them; never for a cluster address (its errors belong to
the run's start_workers stage) or in-process engines; where the early start fails, a warning, and Ray is left
for the stage to start. Real Ray in a fresh process (~10 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import json, logging, os, sys
import ray
from rlstages.configs import load_config
from rlstages.tasks.driver import cluster

tiny = sys.argv[1]
warnings = []
handler = logging.Handler()
handler.emit = lambda r: warnings.append(r.getMessage())
logging.getLogger(cluster.__name__).addHandler(handler)
skipped = []
for extra in (["cluster.address=127.0.0.1:1"], ["cluster.mode=in_process"]):
    cluster.start_local_ray_early(load_config(tiny, extra))
    skipped.append(ray.is_initialized())
real = cluster.start_ray
cluster.start_ray = lambda cfg: (_ for _ in ()).throw(RuntimeError("no room for the GCS"))
cluster.start_local_ray_early(load_config(tiny, []))
failed = {"initialized": ray.is_initialized(), "warnings": warnings}
cluster.start_ray = real
cluster.start_local_ray_early(load_config(tiny, ["model.plugins=[json]", "cluster.num_cpus=1"]))
address = ray.get_runtime_context().gcs_address
cluster.start_ray(load_config(tiny, []))  # the run's start_workers: Ray is up, nothing starts

@ray.remote
def plugins():
    return os.environ.get("RLSTAGES_PLUGINS")

print(json.dumps({"skipped": skipped, "failed": failed, "plugins": ray.get(plugins.remote()),
                  "same": ray.get_runtime_context().gcs_address == address}))
ray.shutdown()
"""


def test_the_runs_own_ray_starts_early_with_its_plugins_and_only_where_it_is_the_runs_own(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"RAY_ADDRESS", "RLSTAGES_PLUGINS"}}
    config = str(ROOT / "configs" / "tiny.yaml")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, config], env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["skipped"] == [False, False]
    assert seen["failed"]["initialized"] is False
    assert any("Ray did not start early (no room for the GCS)" in w for w in seen["failed"]["warnings"])
    assert seen["plugins"] == "json" and seen["same"]
