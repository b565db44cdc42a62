"""What a run measures about its machine once at start-up: the CPU, whether it multiplies bf16 natively
(the `avx512_bf16` / `amx_bf16` CPU flags), the GEMM kernel a bf16 model's linear layers take here (the
choice `actor.fp32_matmul: auto` makes, `rlstages.engines.training.fp32_matmul`) and the threads per worker.
The CLI prints it, MLflow records it as `machine.*` tags (runs on different machines told apart in `compare`),
and `rlstages doctor` names the class of CPU the README's demo times were measured on.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
SIMD_FLAGS = ("avx512f", "avx2")  # the widest vector unit: AVX-512, else AVX2 (most laptops and many cloud VMs)


@dataclass(frozen=True)
class Machine:
    """One machine as a run sees it."""

    cpu: str
    cpus: int
    bf16_flags: tuple[str, ...]  # those of NATIVE_BF16_FLAGS the CPU has
    threads: int
    gemm: str  # the kernel a bf16 linear layer runs on, and why (the fp32 kernel's speed-up as timed)
    simd: tuple[str, ...] = ()  # those of SIMD_FLAGS the CPU has
    rollout: str = ""  # the weights the HF rollout's fast step multiplies here ("": not an HF rollout)

    @property
    def cpu_class(self) -> str:
        """The class the README's demo times are given for: "native-bf16", "avx512" (AVX-512 without bf16) or
        "avx2" (AVX2 or less: no AVX-512)."""
        return "native-bf16" if self.native_bf16 else "avx512" if "avx512f" in self.simd else "avx2"

    @property
    def simd_text(self) -> str:
        """'AVX-512' or 'AVX2 only (no AVX-512)'."""
        return "AVX-512" if "avx512f" in self.simd else "AVX2 only (no AVX-512)" if self.simd else "no AVX2"

    @property
    def native_bf16(self) -> bool:
        """True when the CPU has a bf16 dot-product instruction (AVX512_BF16 or AMX)."""
        return bool(self.bf16_flags)

    @property
    def bf16_text(self) -> str:
        """'yes (avx512_bf16)' or 'no (neither AVX512_BF16 nor AMX)'."""
        return f"yes ({', '.join(self.bf16_flags)})" if self.native_bf16 else "no (no avx512_bf16, no amx_bf16)"

    def line(self) -> str:
        """The start-up line."""
        rollout = f"; rollout {self.rollout}" if self.rollout else ""
        return (
            f"machine: {self.cpu}, {self.cpus} CPUs; {self.simd_text}; native bf16 {self.bf16_text}; "
            f"GEMM {self.gemm}{rollout}; {self.threads} thread{'s' if self.threads > 1 else ''}/worker"
        )

    def tags(self) -> dict[str, str]:
        """The same as MLflow tags."""
        return {
            "machine.cpu": self.cpu,
            "machine.cpus": str(self.cpus),
            "machine.native_bf16": self.bf16_text,
            "machine.gemm": self.gemm,
            "machine.class": self.cpu_class,
            "machine.rollout": self.rollout,
            "machine.threads_per_worker": str(self.threads),
        }


def _cpuinfo(path: str = "/proc/cpuinfo") -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    for line in text.splitlines():
        if line.startswith("model name") and ":" in line:
            return " ".join(line.split(":", 1)[1].split())
    return platform.processor() or platform.machine() or "unknown CPU"


def bf16_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """Those of NATIVE_BF16_FLAGS among the CPU's flags (none where unknown)."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    flags = next((set(line.split()) for line in text.splitlines() if line.startswith("flags")), set())
    return tuple(f for f in NATIVE_BF16_FLAGS if f in flags)


def simd_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """Those of SIMD_FLAGS among the CPU's flags."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    flags = next((set(line.split()) for line in text.splitlines() if line.startswith("flags")), set())
    return tuple(f for f in SIMD_FLAGS if f in flags)


def rollout_choice(setting: bool | str | None, weights_bf16: bool, threads: int) -> str:
    """The weights the HF rollout's fast step multiplies here (`rollout.fp32_weights`, as
    `fast_step.rollout_compute_dtype` decides it); "" where `setting` is None (another rollout backend)."""
    if setting is None:
        return ""
    if not weights_bf16:
        return "fp32 weights (model in float32)"
    from rlstages.engines.training.fp32_matmul import CLEARLY_FASTER, cpu_has_amx, fp32_kernel_speedup

    if setting is True or (setting == "auto" and not cpu_has_amx() and fp32_kernel_speedup(threads) >= CLEARLY_FASTER):
        return "fp32 copy of the bf16 weights (4 bytes/parameter while generating)"
    return f"bf16 weights (fp32_weights: {str(setting).lower()})"


def gemm_choice(setting: bool | str, computes_in_bf16: bool, threads: int) -> str:
    """The kernel a bf16 model's linear layers run on here, as `wants_fp32_kernel` decides it (timed once)."""
    import torch

    from rlstages.engines.runtime.device import on_cuda
    from rlstages.engines.training.fp32_matmul import CLEARLY_FASTER, cpu_has_amx, fp32_kernel_speedup

    if on_cuda():
        return f"native on {torch.cuda.get_device_name(0)}"
    if not computes_in_bf16:
        return "fp32 (model in float32)"
    if setting is True or setting is False:
        return f"{'fp32 kernel for bf16' if setting else 'bf16'} (fp32_matmul: {str(setting).lower()})"
    if cpu_has_amx():
        return "bf16 (AMX)"
    speedup = fp32_kernel_speedup(threads)
    if speedup >= CLEARLY_FASTER:
        return f"fp32 kernel for bf16 (timed {speedup:.2f}x the bf16 GEMM)"
    return f"bf16 (fp32 kernel timed {speedup:.2f}x)"


@functools.cache
def measure(
    setting: bool | str = "auto",
    computes_in_bf16: bool = True,
    threads: int = 1,
    rollout: bool | str | None = None,
    rollout_bf16: bool = True,
) -> Machine:
    """This machine, measured once per process for each set of arguments (`rollout`: the HF rollout's
    `fp32_weights`, None for another backend)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    gemm = gemm_choice(setting, computes_in_bf16, threads)
    weights = rollout_choice(rollout, rollout_bf16, threads)
    return Machine(cpu_model(), cpus, bf16_flags(), threads, gemm, simd_flags(), weights)
