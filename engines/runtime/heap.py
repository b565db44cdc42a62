"""A worker's memory allocator (`cluster.heap`): the environment variables that choose it, set before the
worker process starts (`worker_env.worker_env`).

Non-goal: tuning inside a running process (glibc and jemalloc read these at start-up).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from typing import Any

# glibc hands every freed block above 32 MB back to the OS and page-faults it in again on the next allocation;
# a training step allocates ~150 MB logits tensors dozens of times, which doubled its wall time on CPU. Keep freed
# memory in the heap instead (measured: update 25 s -> 13 s, generation 10.4 s -> 8.5 s on SmolLM2-135M).
KEEP_FREED_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_TOP_PAD_": str(1 << 28)}
# The bound on it (`cluster.heap: bounded`): blocks of 64 MB and more are mapped and returned when freed (a fixed
# threshold, so glibc does not raise it), and the heap's free top is trimmed past 256 MB; the many smaller
# blocks of a step are still reused without page faults.
BOUNDED_HEAP = {
    "MALLOC_MMAP_THRESHOLD_": str(64 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(256 << 20),
    "MALLOC_TOP_PAD_": str(64 << 20),
}


# One malloc arena per process: glibc otherwise gives each thread that allocates (torch's intra-op threads, Ray's
# and gRPC's) an arena of its own, whose freed blocks no other thread reuses. Measured on the demo's hybrid
# worker: peak RSS 4.11 -> 3.84 GB (2 arenas: 3.97), the same step times.
ONE_ARENA = {"MALLOC_ARENA_MAX": "1"}
# The default (`cluster.heap: jemalloc`): the jemalloc that Ray's wheel ships (ray/core/libjemalloc.so),
# preloaded into the worker. Its size classes fragment less than glibc's heap and freed extents go back to the
# OS, so the peak is close to what is live and the stages between updates give the update's memory back.
# Measured on the demo's hybrid worker over 4 steps: peak RSS 3.43 GB vs 3.84 (glibc, one arena) and 4.11
# (glibc), RSS between updates ~2 GB vs 3.8, the same step times (the re-faulting that made glibc's default
# slow does not show). Where the library is missing (another Ray build) the worker keeps glibc's "keep"
# settings; on a node whose path differs the loader skips it. Its cost: Ray's jemalloc (5.3) gives the OS back the
# pages of every freed block over 8 MB within the next few allocations whatever the decay settings (`oversize_
# threshold` raised to 1 GB: the same), so a 28 MB temporary freed and allocated again is page-faulted in each
# time (an element-wise op on it 6-7 ms against ~1 under glibc, AMX Xeon): a step's hot temporaries stay under
# 8 MB (the log-prob pass's chunks, `algorithms/logits.py`). `dirty_decay_ms:-1` keeps every freed page: the
# demo's worker then grew to 15.6 GB in 8 steps.
JEMALLOC_CONF = "narenas:1,dirty_decay_ms:5000,muzzy_decay_ms:0"


def jemalloc_path() -> str | None:
    """Ray's own libjemalloc.so beside this interpreter's `ray` package, if that build ships it."""
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = os.path.join(next(iter(spec.submodule_search_locations)), "core", "libjemalloc.so")
    return lib if os.path.isfile(lib) else None


def heap_env(heap: str) -> dict[str, str]:
    """Environment variables that choose a worker's allocator (`cluster.heap`)."""
    if heap not in ("jemalloc", "keep", "bounded"):
        raise ValueError(f"heap must be 'jemalloc', 'keep' or 'bounded', got {heap!r}")
    lib = jemalloc_path() if heap == "jemalloc" else None
    if lib is not None:
        preload = " ".join(filter(None, [lib, os.environ.get("LD_PRELOAD", "")]))
        return {"LD_PRELOAD": preload, "MALLOC_CONF": JEMALLOC_CONF, **ONE_ARENA}
    return {**(BOUNDED_HEAP if heap == "bounded" else KEEP_FREED_MEMORY), **ONE_ARENA}


_ALL_ARENAS = 4096  # jemalloc's MALLCTL_ARENAS_ALL: a purge of every arena


@functools.cache
def _mallctl() -> Any:
    """The `mallctl` of jemalloc where this process runs on it (`cluster.heap: jemalloc` preloads it), else None."""
    return getattr(ctypes.CDLL(None), "mallctl", None)


def release_freed_pages() -> bool:
    """Give the OS the pages of freed blocks that jemalloc keeps for reuse (up to `dirty_decay_ms`), where a phase
    that frees many small blocks is followed by one that allocates large ones (the hybrid worker's update, then
    its rollout's fp32 copy and KV cache): they would otherwise sit beside them. False where the process does not
    run on jemalloc. Measured on the AVX2 EPYC (5 demo steps): peak PSS 3.65 GB against 3.70."""
    mallctl = _mallctl()
    if mallctl is None:
        return False
    return mallctl(f"arena.{_ALL_ARENAS}.purge".encode(), None, None, None, ctypes.c_size_t(0)) == 0
