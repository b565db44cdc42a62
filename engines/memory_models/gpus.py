"""The GPUs `rlstages plan --gpu` knows by name: device memory as nvidia-smi reports it, and GPUs per node."""

from __future__ import annotations

GIB = 1 << 30
MIB = 1 << 20
# Device memory nvidia-smi reports per GPU (MiB), by the names `--gpu` takes.
GPUS: dict[str, int] = {"H20": 97871 * MIB, "H100": 81559 * MIB, "H200": 143771 * MIB, "A100-80G": 81920 * MIB}
GPUS_PER_NODE = 8


def capacity(gpu: str | None) -> int | None:
    """Bytes of the GPU named `gpu` (None: no GPU named); a clear error for a name not in GPUS."""
    if gpu is None:
        return None
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu}: expected one of {', '.join(GPUS)}")
    return GPUS[gpu]
