"""`engines/tensordict_import.py`: importing the flow (the driver of every run) does not import torch._dynamo (~2 s
of a core a process), and the torch.compile markings tensordict makes at import are applied, the same, by
`register_with_dynamo()` before a compile. In a fresh interpreter: this worker may have imported both already."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, sys
import rlstages.flows.train
from rlstages.engines import tensordict_import as ti
report = {"dynamo_after_import": "torch._dynamo" in sys.modules, "deferred": sorted({n for n, _ in ti._marked})}
marked = list(ti._marked)
ti.register_with_dynamo()
import torch._dynamo.trace_rules as rules
report["applied"] = all(
    id(fn) in rules._allowed_callable_ids if name == "allow_in_graph" else fn._dynamo_marked_constant
    for name, fn in marked
)
report["left"] = len(ti._marked)
print(json.dumps(report))
"""


def test_the_flow_imports_without_dynamo_and_the_markings_apply_later() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["dynamo_after_import"] is False, "something imports torch._dynamo at module level again"
    assert report["deferred"] == ["allow_in_graph", "assume_constant_result"]  # what tensordict 0.15 marks
    assert report["applied"] is True and report["left"] == 0
