"""A worker process's environment, set before it starts (Ray's `runtime_env`): torch's threads and whether idle
ones spin, its allocator (`heap.heap_env`), oneDNN's primitive cache, and what it inherits from the driver.

Non-goal: tuning inside a running process (OpenMP, glibc, jemalloc and oneDNN read these at start-up).
"""

from __future__ import annotations

import os

from rlstages.engines.runtime.heap import heap_env

# The Hugging Face settings a worker inherits from the driver (also on a remote cluster's nodes).
HF_ENV = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT")
# oneDNN's cache of compiled GEMM primitives in a worker, unless the user sets it: its default keeps 1,024, one per
# shape (a step's micro-batches have many), each with its buffers: ~0.4 GB of the demo's worker on an AMX CPU;
# 64 held 0.3 GB of it at the same speed
ONEDNN_PRIMITIVES = "64"


def worker_env(
    threads: int, extra: dict[str, str] | None = None, omp_passive: bool = True, heap: str = "jemalloc"
) -> dict[str, str]:
    """Environment of a worker process: N torch threads (idle ones sleep at once when `omp_passive`, so
    concurrent workers do not spin against each other), the user's Hugging Face settings (cache, offline
    mode: inherited, not forced), the allocator `heap` names (`heap_env`: jemalloc, or glibc's heap that
    keeps freed memory, no page-fault storm on large tensors, or caps what it keeps) and oneDNN's cache cap."""
    env = {
        **heap_env(heap),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_PRIMITIVES),
    }
    env.update({k: os.environ[k] for k in HF_ENV if k in os.environ})
    if omp_passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    # the user's model registrations (rlstages.engines.models.import_plugins); the compiled log-prob pass turned off
    for key in ("RLSTAGES_PLUGINS", "RLSTAGES_COMPILED_LOGPROBS"):  # (algorithms.fused_logits.COMPILED_ENV)
        if os.environ.get(key):
            env[key] = os.environ[key]
    env.update(extra or {})
    return env
