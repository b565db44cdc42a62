"""Fault injection for chaos tests and drills: make a stage fail once, the way production fails.

`RLSTAGES_FAULTS="generate@2:transient,update_actor@3:kill-actor"` makes `generate` raise a transient
ConnectionError at step 2 (Prefect retries it) and kills the actor's Ray worker at the start of
`update_actor` at step 3 (the flow recovers from the last checkpoint); `fatal` fails the flow run
(a crash to resume from). Each fault fires once per run
directory (a marker file records it), so the retry or the replay goes through.
"""

from __future__ import annotations

import os
from typing import Any

from rlstages.tasks.context import RunHandle

ENV = "RLSTAGES_FAULTS"


def _faults() -> list[tuple[str, int, str]]:
    spec = os.environ.get(ENV, "").strip()
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            where, kind = item.split(":", 1)
            stage, step = where.split("@", 1)
            out.append((stage, int(step), kind))
        except ValueError:
            raise ValueError(f"{ENV}: {item!r} is not stage@step:kind (kinds: transient, fatal, kill-<role>)") from None
    return out


def maybe_fail(run: RunHandle, stage: str, step: int, workers: Any = None) -> None:
    """Raise or kill as `RLSTAGES_FAULTS` asks for this (stage, step), once."""
    for f_stage, f_step, kind in _faults():
        if (f_stage, f_step) != (stage, step):
            continue
        marker = run.path / ".faults" / f"{stage}@{step}-{kind}"
        if marker.exists():
            continue
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        if kind == "transient":
            raise ConnectionError(f"injected transient fault in {stage} at step {step}")
        if kind == "fatal":
            raise RuntimeError(f"injected fatal fault in {stage} at step {step} (the flow run fails)")
        if kind.startswith("kill-") and workers is not None:
            import ray

            group = workers.groups()[kind.removeprefix("kill-")]
            ray.kill(group.handles[0], no_restart=True)
            return
        raise ValueError(f"{ENV}: unknown fault kind {kind!r}")
