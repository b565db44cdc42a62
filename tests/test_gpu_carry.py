"""What the GPU machine is sent (scripts/gpu_stack.py, scripts/gpu_vllm_carry.py, scripts/gpu_parts.sh): a folder
cut into xz parts under the per-call limit with their digests, parts kept between calls, refused when one is
missing or damaged, unpacked whole; vLLM's site pruned of what a run never loads. No network, no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_stack import write_parts  # noqa: E402
from gpu_vllm_carry import CARRIED, LEFT_OUT, PRUNE, VLLM, prune  # noqa: E402

PARTS = ROOT / "scripts" / "gpu_parts.sh"


@pytest.fixture
def packed(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """`tmp_path/gpu/` holding `demo.tar.xz.part-*` (1 MiB each) and `demo.sha256` of 3 MiB of random files."""
    gpu = tmp_path / "gpu"
    files = {"site/a.bin": os.urandom(1 << 20), "site/pkg/b.bin": os.urandom(2 << 20), "site/pkg/c.txt": b"x" * 100}
    for rel, data in files.items():
        (gpu / rel).parent.mkdir(parents=True, exist_ok=True)
        (gpu / rel).write_bytes(data)
    write_parts(gpu, "site", "demo", part_mib=1, level=0)
    return gpu, files


def _parts(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(PARTS), *args], env={**os.environ, **env}, capture_output=True, text=True)


def test_write_parts_cuts_the_folder_under_the_limit_with_digests(packed) -> None:
    gpu, _ = packed
    parts = sorted(gpu.glob("demo.tar.xz.part-*"))
    assert len(parts) >= 3 and all(p.stat().st_size <= 1 << 20 for p in parts)  # random bytes do not compress
    listed = [line.split() for line in (gpu / "demo.sha256").read_text().splitlines()]
    assert [name for _, name in listed] == [p.name for p in parts]
    assert not (gpu / "demo.tar.xz").exists()


def test_parts_kept_between_calls_then_unpacked_whole(packed, tmp_path: Path) -> None:
    gpu, files = packed
    keep = tmp_path / "kept"
    carried = tmp_path / "call"  # one call's working tree: the digest list and the first part only
    carried.mkdir()
    parts = sorted(gpu.glob("demo.tar.xz.part-*"))
    for src in (gpu / "demo.sha256", parts[0]):
        (carried / src.name).write_bytes(src.read_bytes())
    env = {"PARTS_DIR": str(keep), "GPU_DIR": str(carried)}
    first = _parts(env)
    assert first.returncode == 0 and f"demo: {parts[0].name} ok" in first.stdout
    assert f"demo: {parts[1].name} missing" in first.stdout
    refused = _parts(env, "unpack", "demo", str(tmp_path / "out"))
    assert refused.returncode == 2 and "not whole" in refused.stderr and parts[1].name in refused.stderr
    for part in parts[1:]:  # the later calls, each its own part (the first one's working tree is gone)
        for old in carried.glob("demo.tar.xz.part-*"):
            old.unlink()
        (carried / part.name).write_bytes(part.read_bytes())
        assert _parts(env).returncode == 0
    done = _parts(env, "unpack", "demo", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    for rel, data in files.items():
        assert (tmp_path / "out" / rel).read_bytes() == data


def test_a_damaged_part_is_refused(packed, tmp_path: Path) -> None:
    gpu, _ = packed
    part = sorted(gpu.glob("demo.tar.xz.part-*"))[1]
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    out = _parts({"PARTS_DIR": str(tmp_path / "none"), "GPU_DIR": str(gpu)}, "unpack", "demo", str(tmp_path / "o"))
    assert out.returncode == 2 and f"{part.name} damaged" in out.stderr
    assert not (tmp_path / "o").exists()


def test_prune_removes_what_a_run_never_loads(tmp_path: Path) -> None:
    site = tmp_path / "vllm-site"
    kept = ["vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/__init__.py"]
    gone = ["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/third_party/deep_gemm/_C.so", "vllm/__pycache__/x.pyc"]
    for rel in kept + gone:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(b"0" * 1000)
    assert prune(site) == 3000
    assert all((site / rel).exists() for rel in kept)
    assert not any((site / rel).exists() for rel in gone)
    assert not (site / "vllm" / "__pycache__").exists()


def test_the_vllm_pins_are_whole_and_disjoint() -> None:
    names = [pin.split("==")[0] for pin in [VLLM, *CARRIED]]
    assert VLLM == "vllm==0.25.1" and all("==" in pin for pin in CARRIED)
    assert len(set(names)) == len(names) and not set(names) & set(LEFT_OUT)
    assert all(reason for reason in [*LEFT_OUT.values(), *PRUNE.values()])


def test_bench_trl_runs_our_side_on_vllm_with_the_demos_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.bench_trl import _rollout_override
    from rlstages.configs import load_config

    path = ROOT / "configs" / "demo_gpu.yaml"
    hf = load_config(path)
    assert _rollout_override(path) == [] and hf.rollout.backend == "hf"
    monkeypatch.setenv("BENCH_TRL_ROLLOUT", "vllm")
    vllm = load_config(path, _rollout_override(path))
    assert vllm.rollout.backend == "vllm" and vllm.cluster.hybrid_engine
    same = ("n", "temperature", "max_new_tokens", "dtype", "top_p", "top_k")
    assert [getattr(vllm.rollout, k) for k in same] == [getattr(hf.rollout, k) for k in same]


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_parts.sh", "gpu_steps.sh"])
def test_the_gpu_scripts_parse(script: str) -> None:
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)]).returncode == 0


def test_step_4_runs_the_gpu_demo_in_the_async_mode() -> None:
    """Step 4's overrides of configs/demo_gpu.yaml make a valid asynchronous run (checked here, before a GPU)."""
    from rlstages.configs import load_config

    script = (ROOT / "scripts" / "gpu_steps.sh").read_text()
    line = next(x for x in script.splitlines() if x.startswith("ASYNC_DEMO_ARGS="))
    overrides = line.split("=", 1)[1].strip('"').split()
    cfg = load_config(ROOT / "configs" / "demo_gpu.yaml", overrides)
    assert cfg.trainer.mode == "async" and cfg.trainer.async_.max_staleness == 1
    assert not cfg.cluster.hybrid_engine and "$ASYNC_DEMO_ARGS" in script
