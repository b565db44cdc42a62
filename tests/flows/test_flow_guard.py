"""A script that calls a flow at module level, without the `__main__` guard, in a process that spawns a child: the
child's import of the script fails in one line naming the fix, before Prefect starts a temporary server (without the
guard it would start a second run, a server and Ray in every spawned process). The parent's own calls are unaffected.
CPU only, ~10 s (two interpreters import the flow module).
Run: pytest tests/flows/test_flow_guard.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rlstages.flows.flow_guard import GuardedFlow, importing_main_in_child
from rlstages.flows.train import rl_post_train

SCRIPT = """
import multiprocessing
from rlstages.flows.train import rl_post_train

def child() -> None:
    pass

if __name__ == "__mp_main__":  # the spawned child's import of this script: an unguarded call runs there too
    rl_post_train(None)

if __name__ == "__main__":
    worker = multiprocessing.get_context("spawn").Process(target=child)
    worker.start()
    worker.join()
    print("child exit code", worker.exitcode)
"""


def test_a_spawned_childs_import_of_an_unguarded_script_cannot_start_a_run(tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "child exit code 1" in done.stdout, out
    assert "flow 'rl-post-train' was called while a process started by the run imported your script" in out, out
    assert 'if __name__ == "__main__":' in out, out
    assert "temporary server" not in out.lower(), out  # refused before Prefect started anything
    assert not list(tmp_path.glob("runs")) and not list(tmp_path.glob("mlruns")), sorted(tmp_path.iterdir())


def test_every_flow_is_guarded_and_a_plain_process_is_not_a_spawned_import() -> None:
    from rlstages.flows import convert, evaluate, scale

    flows = [rl_post_train, evaluate.evaluate_checkpoint, convert.convert_flow, convert.export_flow]
    flows.append(scale.scale_rollout)
    assert all(isinstance(f, GuardedFlow) for f in flows), [type(f) for f in flows]
    assert not importing_main_in_child()
