"""A worker's environment (engines/runtime/worker_env.py): OpenMP's idle threads, oneDNN's primitive cache cap (the
user's own value kept), the allocators of `cluster.heap` measured in a real child process (freed memory kept or
returned), and inductor's vector ISA taken from the CPU's flags where the C++ compiler builds every ISA (the one
its probe picks). CPU only, seconds: `pytest tests/engines/runtime/test_worker_env.py`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlstages.engines.runtime.worker_env import compiler_builds_every_isa, worker_env


def test_worker_env_lets_openmp_spin_only_when_asked() -> None:
    assert worker_env(2)["OMP_WAIT_POLICY"] == "PASSIVE"
    spin = worker_env(2, omp_passive=False)
    assert "OMP_WAIT_POLICY" not in spin  # libgomp's default: spin briefly, then sleep
    assert spin["OMP_NUM_THREADS"] == "2" and spin["MALLOC_CONF"].startswith("narenas:1")


def test_worker_env_caps_onednns_and_ideeps_caches_unless_the_user_set_them(monkeypatch) -> None:
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert worker_env(1)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"  # oneDNN's own default: 1,024 shapes kept
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    assert worker_env(1)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    assert worker_env(1)["LRU_CACHE_CAPACITY"] == "64"  # ideep's matmul descriptors: 1,024 by default
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "256")
    assert worker_env(1)["LRU_CACHE_CAPACITY"] == "256"


def _fake_compiler(where, banner: str) -> str:
    where.mkdir()
    script = where / "fake-cxx"
    script.write_text(f"#!/bin/sh\necho '{banner}'\n")
    script.chmod(0o755)
    return str(script)


def test_inductors_vector_isa_is_trusted_only_with_a_compiler_that_builds_every_isa(tmp_path, monkeypatch) -> None:
    assert compiler_builds_every_isa(_fake_compiler(tmp_path / "gcc11", "g++ (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0"))
    assert compiler_builds_every_isa(_fake_compiler(tmp_path / "clang14", "Ubuntu clang version 14.0.0-1ubuntu1"))
    assert not compiler_builds_every_isa(_fake_compiler(tmp_path / "gcc8", "g++ (GCC) 8.5.0 20210514 (Red Hat)"))
    assert compiler_builds_every_isa(_fake_compiler(tmp_path / "cxx12", "c++ (GCC) 12.2.1 20221121 (Red Hat 12.2.1-7)"))
    assert not compiler_builds_every_isa(str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCHINDUCTOR_VEC_ISA_OK", "0")
    assert worker_env(1)["TORCHINDUCTOR_VEC_ISA_OK"] == "0"  # the user's own value kept


_PICKED_ISA = "from torch._inductor.cpu_vec_isa import pick_vec_isa; print(pick_vec_isa())"


def test_the_trusted_vector_isa_is_the_one_inductors_probe_picks(monkeypatch) -> None:
    import os

    monkeypatch.delenv("TORCHINDUCTOR_VEC_ISA_OK", raising=False)
    env = worker_env(1)
    if "TORCHINDUCTOR_VEC_ISA_OK" not in env:
        pytest.skip("this machine's C++ compiler is older than GCC 11 / Clang 12: inductor probes as before")
    picked = [
        subprocess.run([sys.executable, "-c", _PICKED_ISA], env={**os.environ, **extra}, capture_output=True,
                       text=True, check=True).stdout.strip()
        for extra in ({}, {"TORCHINDUCTOR_VEC_ISA_OK": env["TORCHINDUCTOR_VEC_ISA_OK"]})
    ]  # fmt: skip
    assert picked[0] and picked[0] == picked[1]


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


_RSS_AFTER_RELEASE = """
from rlstages.engines.runtime.heap import release_freed_pages
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) // 1024
blocks = [bytearray(8000) for _ in range(40000)]  # 320 MB of small blocks: jemalloc keeps their pages when freed
del blocks
kept = rss()
print(kept, release_freed_pages(), rss())
"""


@pytest.mark.parametrize("heap", ["jemalloc", "keep"])
def test_a_phase_boundary_gives_jemallocs_freed_pages_back(heap) -> None:
    """`release_freed_pages`: the pages jemalloc keeps of freed small blocks go back to the OS at once (the hybrid
    worker calls it between its update and its rollout); under glibc it does nothing and says so."""
    env = {k: v for k, v in worker_env(1, heap=heap).items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", _RSS_AFTER_RELEASE], env={**os.environ, **env},
                         capture_output=True, text=True, check=True)  # fmt: skip
    kept, released, after = out.stdout.split()
    assert released == str(heap == "jemalloc")
    if heap == "jemalloc":
        assert int(kept) >= 250 and int(after) < int(kept) - 200
