"""How long this process has spent compiling with `torch.compile` (dynamo and inductor, forward and backward):
a one-off cost of the first steps (the bf16 AdamW compiles its per-tensor step on first use) that the run's
ETA leaves out of the time a later step takes (`flows.progress`)."""

from __future__ import annotations

COMPILE_METRIC = "perf/compile_s"  # a step's seconds spent compiling (`perf/compile_s/actor` as logged): a one-off


def compile_seconds() -> float:
    """Seconds spent in `torch.compile` so far in this process (0.0 where torch does not say)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # noqa: BLE001 - a private torch API: an ETA must never fail a step
        return 0.0
