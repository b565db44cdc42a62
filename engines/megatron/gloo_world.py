"""Run a function on N local worker processes joined in one torch.distributed world (gloo on CPU).

Workers are fresh `python -m rlstages.engines.megatron.gloo_world` processes (no fork of the caller, no re-import of
the caller's `__main__`), on a free port of 127.0.0.1. The function is named "module:function", is called
as `fn(rank, world_size, master_port, **kwargs)` and returns something JSON-serialisable.
Non-goal: Ray or multi-node launches (the training backends own those).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlstages.engines.imports import import_object
from rlstages.engines.utils import free_port


def run_world(target: str, world_size: int, kwargs: dict[str, Any], timeout: float = 600.0) -> list[Any]:
    """Start `world_size` workers running `target`; return their results by rank, or raise with a log tail."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gloo-world-") as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"target": target, "world_size": world_size, "port": port, "kwargs": kwargs}))
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        procs, logs = [], []
        for rank in range(world_size):
            log = open(Path(tmp) / f"rank{rank}.log", "w+")  # noqa: SIM115  (closed below)
            logs.append(log)
            cmd = [sys.executable, "-m", "rlstages.engines.megatron.gloo_world", str(job), str(rank)]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd()))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        bad = [r for r, p in enumerate(procs) if p.returncode != 0]
        if bad:
            log = logs[bad[0]]
            log.seek(0)
            tail = log.read()[-3000:]
            for f in logs:
                f.close()
            why = "timed out" if time.monotonic() > deadline else f"exited with {procs[bad[0]].returncode}"
            raise RuntimeError(f"{target}: worker rank {bad[0]} of {world_size} {why}; its log ends with:\n{tail}")
        for f in logs:
            f.close()
        return [json.loads((Path(tmp) / f"result{r}.json").read_text()) for r in range(world_size)]


def _main(job_path: str, rank: int) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    job = json.loads(Path(job_path).read_text())
    fn = import_object(job["target"], "gloo_world target", expected="function")
    result = fn(rank, job["world_size"], job["port"], **job["kwargs"])
    (Path(job_path).parent / f"result{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]))
