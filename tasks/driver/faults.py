"""Fault injection for chaos tests and drills: make a stage fail once, the way production fails.

`RLSTAGES_FAULTS="generate@2:transient,update_actor@3:kill-actor"` makes `generate` raise a transient
ConnectionError at step 2 (Prefect retries it) and kills the actor's Ray worker at the start of
`update_actor` at step 3 (the flow recovers from the last checkpoint); `fatal` fails the flow run
(a crash to resume from); `sigkill` kills the flow process itself (at `checkpoint_commit`: between the
rename of a checkpoint and its manifest); `sigterm` / `sigint` send the flow process that signal, as a scheduler
or Ctrl-C does (the flow stops at a safe point: flows/interrupts.py), and `sigterm-group` / `sigint-group` send it to
the flow process's whole process group, the processes the run started included, as a terminal's Ctrl-C, `timeout`
or a systemd unit's stop does; `nan` poisons the step's training batch so
its loss is NaN (`update_actor` / `update_critic`). Each fault fires once per run directory (a marker file records it),
so the retry or the replay goes through. The spec is checked before a run starts (`parse_faults`).
"""

from __future__ import annotations

import os
import signal
from typing import Any

from rlstages.tasks.driver.context import RunHandle

ENV = "RLSTAGES_FAULTS"
KINDS = ("transient", "fatal", "sigkill", "sigterm", "sigint", "sigterm-group", "sigint-group", "nan")
ROLES = ("actor", "critic", "rollout", "reference", "reward", "reward_model")
EXTRA_STAGES = ("checkpoint_commit",)


def parse_faults(spec: str | None = None, stages: tuple[str, ...] = ()) -> list[tuple[str, int, str]]:
    """The (stage, step, kind) triples of a spec (default: the environment); ValueError naming the bad item."""
    spec = os.environ.get(ENV, "") if spec is None else spec
    out = []
    kinds = (*KINDS, *(f"kill-{r}" for r in ROLES))
    for item in filter(None, (s.strip() for s in spec.strip().split(","))):
        try:
            where, kind = item.split(":", 1)
            stage, step = where.split("@", 1)
            out.append((stage.strip(), int(step), kind.strip()))
        except ValueError:
            expected = f"stage@step:kind (kinds: {', '.join(KINDS)}, kill-<role>)"
            raise ValueError(f"{ENV}: {item!r} is not {expected}") from None
        if kind.strip() not in kinds:
            raise ValueError(f"{ENV}: {item!r} has an unknown kind {kind!r}; expected one of {', '.join(kinds)}")
        if stages and stage.strip() not in (*stages, *EXTRA_STAGES):
            raise ValueError(f"{ENV}: {item!r} names an unknown stage {stage!r}; expected one of {', '.join(stages)}")
    return out


def _fire(run: RunHandle, stage: str, step: int) -> list[str]:
    """The fault kinds due at (stage, step) that have not fired in this run directory yet (marked as fired)."""
    due = []
    for f_stage, f_step, kind in parse_faults():
        if (f_stage, f_step) != (stage, step):
            continue
        marker = run.path / ".faults" / f"{stage}@{step}-{kind}"
        if marker.exists():
            continue
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        due.append(kind)
    return due


def maybe_fail(run: RunHandle, stage: str, step: int, workers: Any = None) -> None:
    """Raise or kill as `RLSTAGES_FAULTS` asks for this (stage, step), once (`nan` is `poison_batch`'s)."""
    for kind in _fire(run, stage, step):
        if kind == "transient":
            raise ConnectionError(f"injected transient fault in {stage} at step {step}")
        if kind == "fatal":
            raise RuntimeError(f"injected fatal fault in {stage} at step {step} (the flow run fails)")
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind in ("sigterm", "sigint"):
            os.kill(os.getpid(), signal.SIGTERM if kind == "sigterm" else signal.SIGINT)
        if kind in ("sigterm-group", "sigint-group"):
            os.killpg(0, signal.SIGTERM if kind == "sigterm-group" else signal.SIGINT)  # 0: this process's group
        if kind == "nan":
            _NAN_DUE.add((run.run_dir, stage, step))
        if kind.startswith("kill-") and workers is not None:
            import ray

            group = workers.groups()[kind.removeprefix("kill-")]
            ray.kill(group.handles[0], no_restart=True)


_NAN_DUE: set[tuple[str, str, int]] = set()


def nan_due(run: RunHandle, stage: str, step: int) -> bool:
    """True once when a `nan` fault fired for (stage, step): the caller poisons the step's batch."""
    key = (run.run_dir, stage, step)
    if key in _NAN_DUE:
        _NAN_DUE.discard(key)
        return True
    return False
