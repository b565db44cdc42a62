"""A worker's environment (engines/runtime/worker_env.py): OpenMP's idle threads, oneDNN's primitive cache cap (the
user's own value kept), and the allocators of `cluster.heap` measured in a real child process (freed memory kept or
returned). CPU only, seconds: `pytest tests/engines/runtime/test_worker_env.py`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlstages.engines.runtime.worker_env import worker_env


def test_worker_env_lets_openmp_spin_only_when_asked() -> None:
    assert worker_env(2)["OMP_WAIT_POLICY"] == "PASSIVE"
    spin = worker_env(2, omp_passive=False)
    assert "OMP_WAIT_POLICY" not in spin  # libgomp's default: spin briefly, then sleep
    assert spin["OMP_NUM_THREADS"] == "2" and spin["MALLOC_CONF"].startswith("narenas:1")


def test_worker_env_caps_onednns_primitive_cache_unless_the_user_set_it(monkeypatch) -> None:
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert worker_env(1)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"  # oneDNN's own default: 1,024 shapes kept
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    assert worker_env(1)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"


_RSS_AFTER_FREE = """
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) // 1024
blocks = [bytearray(100 << 20) for _ in range(3)]  # 300 MB, touched (zero-filled)
high = rss()
del blocks
print(high, rss(), "libjemalloc" in open('/proc/self/maps').read())
"""


@pytest.mark.parametrize("heap", ["jemalloc", "keep", "bounded"])
def test_worker_heap_settings_keep_or_return_freed_memory(heap) -> None:
    env = {k: v for k, v in worker_env(1, heap=heap).items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", _RSS_AFTER_FREE], env=env, capture_output=True, text=True, check=True)
    high, after, jemalloc = out.stdout.split()
    assert int(high) >= 300 and (jemalloc == "True") == (heap == "jemalloc")
    if heap == "keep":
        assert int(after) >= 300  # every freed block stays in the heap (no re-faulting on the next step)
    else:
        assert int(after) < 100  # freed blocks go back to the OS: the peak is what is live
    with pytest.raises(ValueError, match="heap"):
        worker_env(1, heap="lots")
