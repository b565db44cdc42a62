"""Stage profiles inside a worker: `torch.profiler` around the calls of one stage, and the memory it took.

`start(engine, options)` (run inside the worker, e.g. through `ActorGroup.each`) starts a profiler of the CPU and,
where present, CUDA activities; `stop(engine)` ends it and returns the files as bytes: `trace.json` (Chrome /
Perfetto trace), `top_ops.txt` (the operators by self time), and with `memory`: `peak_rss.json` (the process's
peak resident set during the stage: VmHWM after resetting it through /proc/self/clear_refs; and the bytes of the
tensors the engine holds at the stage's end, `engine_tensor_bytes`) and on CUDA
`memory_snapshot.pickle` (`torch.cuda.memory._record_memory_history` -> `_dump_snapshot`, for PyTorch's memory
viz at pytorch.org/memory_viz) with `max_memory_allocated`. One profiler per process: a second engine in the same
process (in-process groups, the hybrid engine) is not profiled again while the first one records.
`profile_stage` is the same as a context manager for code that runs in one process. No Prefect, no MLflow.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlstages.engines.runtime.device import on_cuda
from rlstages.engines.runtime.tensor_census import reachable_tensor_bytes

SNAPSHOT_ENTRIES = 100_000  # allocation events kept by the CUDA memory history


@dataclass(frozen=True)
class ProfileOptions:
    """What to record: shapes of operator inputs, Python stacks, memory (profiler memory + peak RSS / CUDA
    snapshot); `row_limit` rows of the top-ops table."""

    record_shapes: bool = False
    with_stack: bool = False
    memory: bool = False
    row_limit: int = 30


_ACTIVE: dict[str, Any] = {}  # the process's one running profiler: {"owner", "profiler", "options"}


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux: clear_refs 5); False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int | None:
    """The process's peak resident set (VmHWM) in bytes, None where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def start(engine: Any, options: ProfileOptions) -> bool:
    """Start profiling in this process on behalf of `engine`; False when another engine's profiler runs here."""
    if _ACTIVE:
        return False
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = on_cuda(getattr(engine, "device", torch.device("cpu")))  # the engine's (its worker's), not the node's
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    if options.memory and cuda:
        torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
        torch.cuda.reset_peak_memory_stats()
    rss_reset = _reset_peak_rss() if options.memory else False
    profiler = torch.profiler.profile(
        activities=activities,
        record_shapes=options.record_shapes,
        with_stack=options.with_stack,
        profile_memory=options.memory,
    )
    profiler.start()
    _ACTIVE.update(owner=id(engine), profiler=profiler, options=options, cuda=cuda, rss_reset=rss_reset)
    return True


def stop(engine: Any) -> dict[str, bytes]:
    """End `engine`'s profiler and return its files by name ({} when it started none)."""
    if _ACTIVE.get("owner") != id(engine):
        return {}
    state = dict(_ACTIVE)
    _ACTIVE.clear()
    profiler, options = state["profiler"], state["options"]
    profiler.stop()
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        profiler.export_chrome_trace(trace)
        files["trace.json"] = Path(trace).read_bytes()
        sort = "self_cuda_time_total" if state["cuda"] else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort, row_limit=options.row_limit)
        files["top_ops.txt"] = table.encode()
        if options.memory:
            memory: dict[str, Any] = {"pid": os.getpid(), "peak_rss_bytes": peak_rss_bytes()}
            memory["peak_rss_since"] = "stage start" if state["rss_reset"] else "process start"
            memory["engine_tensor_bytes"] = reachable_tensor_bytes(engine)  # what the engine holds after the stage
            if state["cuda"]:
                snapshot = os.path.join(tmp, "memory_snapshot.pickle")
                torch.cuda.memory._dump_snapshot(snapshot)
                torch.cuda.memory._record_memory_history(enabled=None)
                files["memory_snapshot.pickle"] = Path(snapshot).read_bytes()
                memory["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated()
            files["peak_rss.json"] = json.dumps(memory, indent=1).encode()
    return files


@contextmanager
def profile_stage(engine: Any, options: ProfileOptions, out: dict[str, bytes]) -> Iterator[None]:
    """`start` ... `stop` around a block; the files land in `out`."""
    started = start(engine, options)
    try:
        yield
    finally:
        if started:
            out.update(stop(engine))
