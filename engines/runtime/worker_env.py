"""A worker process's environment, set before it starts (Ray's `runtime_env`): torch's threads and whether idle
ones spin, its allocator (`heap.heap_env`), oneDNN's primitive cache, and what it inherits from the driver.

Non-goal: tuning inside a running process (OpenMP, glibc, jemalloc and oneDNN read these at start-up).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess

from rlstages.engines.runtime.heap import heap_env

# The Hugging Face settings a worker inherits from the driver (also on a remote cluster's nodes).
HF_ENV = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT")
# oneDNN's cache of compiled GEMM primitives in a worker, unless the user sets it: its default keeps 1,024, one per
# shape (a step's micro-batches have many), each with its buffers: ~0.4 GB of the demo's worker on an AMX CPU;
# 64 held 0.3 GB of it at the same speed
ONEDNN_PRIMITIVES = "64"
# ideep's (PyTorch's oneDNN wrapper) own cache of matmul primitive descriptors, `LRU_CACHE_CAPACITY` (1,024 by
# default): a brgemm descriptor per GEMM shape, and a decode step's row counts and the micro-batches' token counts
# make hundreds; a jemalloc heap profile of the demo's worker put 124 MB of it live at a generation's end (AMX Xeon).
# 64 entries: 6 demo steps' peak PSS 3.42-3.44 GB against 3.60, the steps' times the same (docs/benchmarks.md, round 34)
IDEEP_DESCRIPTORS = "64"
# inductor's vector ISA taken from the CPU's flags (TORCHINDUCTOR_VEC_ISA_OK=1) where the C++ compiler builds every
# ISA it knows (AMX's included): GCC 11 or Clang 12 on. Otherwise each worker's first compile (the bf16 AdamW step,
# `training/sr_adamw.py`) builds a probe library per ISA and loads each in a child Python: 1.2 s of the demo's
# first update with the compile cache warm, 5.8 s on a machine's first run (AMX Xeon; docs/benchmarks.md, round 32)
MIN_COMPILER = {"gcc": 11, "clang": 12}


def worker_env(
    threads: int, extra: dict[str, str] | None = None, omp_passive: bool = True, heap: str = "jemalloc"
) -> dict[str, str]:
    """Environment of a worker process: N torch threads (idle ones sleep at once when `omp_passive`, so
    concurrent workers do not spin against each other), the user's Hugging Face settings (cache, offline
    mode: inherited, not forced), the allocator `heap` names (`heap_env`: jemalloc, or glibc's heap that
    keeps freed memory, no page-fault storm on large tensors, or caps what it keeps) and oneDNN's and ideep's cache
    caps (the user's values kept)."""
    env = {
        **heap_env(heap),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_PRIMITIVES),
        "LRU_CACHE_CAPACITY": os.environ.get("LRU_CACHE_CAPACITY", IDEEP_DESCRIPTORS),
    }
    if "TORCHINDUCTOR_VEC_ISA_OK" in os.environ:
        env["TORCHINDUCTOR_VEC_ISA_OK"] = os.environ["TORCHINDUCTOR_VEC_ISA_OK"]
    elif compiler_builds_every_isa(os.environ.get("CXX") or "g++"):
        env["TORCHINDUCTOR_VEC_ISA_OK"] = "1"
    env.update({k: os.environ[k] for k in HF_ENV if k in os.environ})
    if omp_passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    # the user's model registrations (rlstages.engines.models.import_plugins); the compiled log-prob pass turned off
    for key in ("RLSTAGES_PLUGINS", "RLSTAGES_COMPILED_LOGPROBS"):  # (algorithms.fused_logits.COMPILED_ENV)
        if os.environ.get(key):
            env[key] = os.environ[key]
    env.update(extra or {})
    return env


@functools.cache
def compiler_builds_every_isa(cxx: str) -> bool:
    """Whether the C++ compiler `cxx` (inductor's: $CXX, else g++) is a GCC >= 11 or a Clang >= 12, which build
    AMX, AVX-512 and AVX2 code; False when it is missing, older or unknown."""
    path = shutil.which(cxx)
    if path is None:
        return False
    try:
        first = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return False
    found = re.search(r"(\d+)\.\d+(?:\.\d+)?", first[0]) if first else None
    if found is None:
        return False
    banner = first[0].lower()  # "g++ (Ubuntu 11.4.0) 11.4.0", "c++ (GCC) 12.2.1", "Ubuntu clang version 14.0.0"
    kind = "clang" if "clang" in banner else "gcc" if re.search(r"g\+\+|gcc", banner) else None
    return kind is not None and int(found.group(1)) >= MIN_COMPILER[kind]
