"""docs/agentic.md's tool example runs as printed: saved as my_tools.py, it prints the block shown after it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "agentic.md"


def test_docs_example_runs_and_prints_what_the_docs_show(tmp_path: Path) -> None:
    text = DOC.read_text()
    code = re.search(r"```python\n(\"\"\"my_tools\.py.*?)```", text, re.DOTALL).group(1)
    shown = re.search(r"It prints:\n\n```text\n(.*?)```", text, re.DOTALL).group(1)
    (tmp_path / "my_tools.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "my_tools.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == shown
