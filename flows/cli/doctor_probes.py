"""The probes of `rlstages doctor`: versions of every stack piece; which rollout and training backends can run here
(no GPU, package missing, an import that fails on a version clash); the Ray cluster's resources (RAY_ADDRESS);
whether the Prefect and MLflow endpoints answer; the machine's class for the README's demo times (CPU, native bf16
flags, the GEMM kernel the demo's bf16 layers take here); the settings that matter (thread counts,
CUDA_DEVICE_MAX_CONNECTIONS for Megatron, heartbeats). Backend packages are imported in subprocesses with a
timeout, never here: a broken install cannot hang or crash the doctor, and flows never import the backends
(design §1).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlstages.engines.registry import BACKEND_PACKAGES, has_module
from rlstages.flows.cli.demo_times import class_times

if TYPE_CHECKING:
    from rlstages.engines.training.machine import Machine

PACKAGES = ("torch", "transformers", "prefect", "ray", "mlflow", "pydantic", "tensordict", "safetensors", "typer")
OPTIONAL = ("deepspeed", "megatron-core", "vllm", "sglang", "flash-attn", "transformer-engine")
SETTINGS = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "TOKENIZERS_PARALLELISM",
    "PYTORCH_CUDA_ALLOC_CONF",
    "NCCL_SOCKET_IFNAME",
    "RAY_ADDRESS",
    "RAY_AUTH_MODE",
    "PREFECT_API_URL",
    "PREFECT_FLOWS_HEARTBEAT_FREQUENCY",
    "MLFLOW_TRACKING_URI",
    "HF_HUB_OFFLINE",
)


@dataclass(frozen=True)
class Check:
    """One line of the report: ok True/False, or None for plain information."""

    section: str
    name: str
    ok: bool | None
    detail: str


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _run(cmd: list[str], timeout: float) -> tuple[bool, str]:
    """Run a probe; (succeeded, last line of output or the error)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    except OSError as exc:
        return False, str(exc)
    text = (proc.stdout if proc.returncode == 0 else proc.stderr or proc.stdout).strip().splitlines()
    return proc.returncode == 0, (text[-1] if text else f"exit {proc.returncode}")[:300]


def _import_probe(python: str, module: str, timeout: float) -> tuple[bool, str]:
    code = f"import {module} as m; print(getattr(m, '__version__', 'imported'))"
    return _run([python, "-c", code], timeout)


def versions() -> list[Check]:
    """Python, the platform and every stack package (optional ones may be missing)."""
    rows = [Check("versions", "python", None, f"{platform.python_version()} ({sys.executable})")]
    rows.append(Check("versions", "platform", None, f"{platform.system()} {platform.machine()}"))
    for dist in PACKAGES:
        v = _version(dist)
        rows.append(Check("versions", dist, v is not None, v or "missing"))
    for dist in OPTIONAL:
        rows.append(Check("versions", dist, None, _version(dist) or "not installed"))
    return rows


def gpus() -> tuple[int, str]:
    """(number of CUDA devices torch sees, a description)."""
    try:
        import torch
    except ImportError:
        return 0, "torch missing"
    from rlstages.engines.runtime.device import visible_gpus

    cuda = torch.version.cuda or "cpu build"
    machine, usable = visible_gpus(), torch.cuda.device_count()
    if not usable:
        on_machine = f"{machine} GPU(s) on this machine (nvidia-smi) but " if machine else ""
        return 0, f"{on_machine}no CUDA device (torch {torch.__version__}, {cuda})"
    names = {torch.cuda.get_device_name(i) for i in range(usable)}
    return usable, f"{usable} x {', '.join(sorted(names))} (CUDA {cuda})"


def vllm_interpreter(explicit: Path | None) -> Path | None:
    """The vLLM venv's interpreter: `explicit`, else the one the rollout's actors would run
    (`rlstages.engines.rollout.vllm_rollout.default_vllm_python`), else None."""
    if explicit is not None:
        return explicit
    from rlstages.engines.rollout.vllm_rollout import default_vllm_python

    found = default_vllm_python()
    return Path(found) if found else None


def backends(vllm_python: Path | None, timeout: float = 180.0) -> list[Check]:
    """Which rollout and training backends can run here, each with the reason when not."""
    n_gpu, gpu_text = gpus()
    rows = [Check("backends", "gpu", n_gpu > 0, gpu_text)]
    rows.append(Check("backends", "rollout hf", _version("transformers") is not None, "transformers generate, CPU/GPU"))
    rows.append(Check("backends", "training torch", _version("torch") is not None, "plain torch, CPU/GPU"))
    probes: dict[str, Any] = {}
    with ThreadPoolExecutor(4) as pool:
        if vllm_python is not None and vllm_python.is_file():
            probes["vllm-venv"] = pool.submit(_import_probe, str(vllm_python), "vllm", timeout)
        if has_module("vllm"):
            probes["vllm"] = pool.submit(_import_probe, sys.executable, "vllm", timeout)
        if has_module("sglang"):
            probes["sglang"] = pool.submit(_import_probe, sys.executable, "sglang", timeout)
        if has_module("deepspeed"):
            probes["deepspeed"] = pool.submit(_import_probe, sys.executable, "deepspeed", timeout)
        if has_module("megatron"):
            probes["megatron"] = pool.submit(_import_probe, sys.executable, "megatron.core", timeout)
        results = {k: f.result() for k, f in probes.items()}
    rows.append(_vllm_row(results, vllm_python, n_gpu))
    rows.append(_gpu_only_row("rollout sglang", results.get("sglang"), n_gpu, BACKEND_PACKAGES["sglang"][1]))
    rows.append(_train_row("training deepspeed", results.get("deepspeed"), "ZeRO 1-3 (gloo on CPU)", "deepspeed"))
    rows.append(_train_row("training megatron", results.get("megatron"), "Megatron-Core (CPU needs shims)", "megatron"))
    return rows


def _vllm_row(results: dict[str, tuple[bool, str]], vllm_python: Path | None, n_gpu: int) -> Check:
    if "vllm-venv" in results and vllm_python is not None:
        ok, text = results["vllm-venv"]
        why = f"vllm {text} in {vllm_python.parent.parent}" if ok else f"{vllm_python}: import vllm failed: {text}"
        return Check("backends", "rollout vllm", ok, why)
    if "vllm" in results:
        ok, text = results["vllm"]
        if not ok:
            return Check("backends", "rollout vllm", False, f"import vllm failed (version clash?): {text}")
        return Check("backends", "rollout vllm", n_gpu > 0, f"vllm {text}" + ("" if n_gpu else ", but no GPU"))
    if vllm_python is None:
        from rlstages.engines.rollout.vllm_rollout import vllm_venv_candidates

        where = " or ".join(str(venv) for venv in vllm_venv_candidates())
        return Check("backends", "rollout vllm", False, f"not installed: {BACKEND_PACKAGES['vllm'][1]}; no {where}")
    return Check("backends", "rollout vllm", False, f"not installed: {BACKEND_PACKAGES['vllm'][1]}; no {vllm_python}")


def _gpu_only_row(name: str, probe: tuple[bool, str] | None, n_gpu: int, hint: str) -> Check:
    if probe is None:
        return Check("backends", name, False, f"not installed: {hint}")
    ok, text = probe
    if not ok:
        return Check("backends", name, False, f"import failed (version clash?): {text}")
    return Check("backends", name, n_gpu > 0, f"{text}" + ("" if n_gpu else "; needs a GPU, none here"))


def _train_row(name: str, probe: tuple[bool, str] | None, what: str, backend: str) -> Check:
    if probe is None:
        return Check("backends", name, False, f"not installed: {BACKEND_PACKAGES[backend][1]}")
    ok, text = probe
    return Check("backends", name, ok, f"{text}: {what}" if ok else f"import failed (version clash?): {text}")


_RAY_PROBE = """
import json, os, ray
ray.init(address=os.environ["RLSTAGES_PROBE_ADDRESS"], log_to_driver=False, logging_level="ERROR")
nodes = [{"id": n["NodeID"][:12], "ip": n["NodeManagerAddress"], "resources": n["Resources"]}
         for n in ray.nodes() if n["Alive"]]
print(json.dumps({"total": ray.cluster_resources(), "available": ray.available_resources(), "nodes": nodes}))
"""


def ray_cluster(address: str | None, timeout: float = 90.0) -> list[Check]:
    """Resources of the Ray cluster at `address` (probed in a subprocess), or what a run does without one."""
    if not address:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return [Check("ray", "cluster", None, f"none (RAY_ADDRESS unset): each run starts a local Ray, {cpus} CPUs")]
    env = {
        **os.environ,
        "RLSTAGES_PROBE_ADDRESS": address,
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _RAY_PROBE], capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return [Check("ray", "cluster", False, f"{address}: no answer within {timeout:.0f} s")]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [Check("ray", "cluster", False, f"{address}: {tail[:300]}")]
    info = json.loads(lines[-1])
    rows = [Check("ray", "cluster", True, f"{address}: {len(info['nodes'])} nodes, total {_res(info['total'])}")]
    rows.append(Check("ray", "available", None, _res(info["available"])))
    for node in info["nodes"]:
        rows.append(Check("ray", f"node {node['id']}", True, f"{node['ip']}: {_res(node['resources'])}"))
    return rows


def _res(resources: dict[str, float]) -> str:
    shown = {k: v for k, v in sorted(resources.items()) if not k.startswith("node:") and "memory" not in k}
    return ", ".join(f"{k}={v:g}" for k, v in shown.items()) or "none"


def _get(url: str, timeout: float = 5.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200, resp.read(200).decode(errors="replace").strip()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        return False, str(getattr(exc, "reason", exc))


def prefect_endpoint(api_url: str | None) -> list[Check]:
    """Whether the Prefect API answers, and whether its version matches this client."""
    client = _version("prefect") or "?"
    if not api_url:
        return [Check("prefect", "api", None, "PREFECT_API_URL unset: flows run against a temporary local server")]
    ok, text = _get(f"{api_url.rstrip('/')}/health")
    if not ok:
        return [Check("prefect", "api", False, f"{api_url}: {text}")]
    _, server = _get(f"{api_url.rstrip('/')}/admin/version")
    server = server.strip('"')
    same = server == client
    detail = f"{api_url}: healthy, server {server}, client {client}" + ("" if same else " (mismatch: expect 422s)")
    return [Check("prefect", "api", True, detail)]


def mlflow_endpoint(tracking_uri: str) -> list[Check]:
    """Whether the MLflow tracking server answers, or where a local SQLite store lives."""
    if tracking_uri.startswith("http"):
        ok, text = _get(f"{tracking_uri.rstrip('/')}/health")
        if not ok:
            return [Check("mlflow", "tracking", False, f"{tracking_uri}: {text}")]
        _, version = _get(f"{tracking_uri.rstrip('/')}/version")
        return [Check("mlflow", "tracking", True, f"{tracking_uri}: healthy, server {version}")]
    if tracking_uri.startswith("sqlite:///"):
        path = Path(tracking_uri.removeprefix("sqlite:///"))
        where = path.resolve().parent
        writable = os.access(where, os.W_OK)
        state = "exists" if path.is_file() else "created on the first run"
        return [Check("mlflow", "tracking", writable, f"{tracking_uri}: local SQLite store ({state})")]
    return [Check("mlflow", "tracking", None, f"{tracking_uri}: not checked")]


def demo_class(m: Machine) -> str:
    """The class of a machine's demo times (`demo_times.DEMO_ROWS`): its `cpu_class`, with AMX told apart from
    AVX512_BF16 alone (~2x its bf16 GEMM)."""
    return "native-bf16-amx" if "amx_bf16" in m.bf16_flags else m.cpu_class


def machine() -> list[Check]:
    """The CPU, its bf16 flags, the GEMM kernel the demo's bf16 layers take here, and the demo's time for its class."""
    from rlstages.engines.training.machine import measure

    m = measure("auto", True, 2, "auto")  # the demo's actor and rollout: bf16, auto, 2 threads per worker
    return [
        Check("machine", "cpu", None, f"{m.cpu}, {m.cpus} CPUs"),
        Check("machine", "native bf16", None, m.bf16_text),
        Check("machine", "vector unit", None, m.simd_text),
        Check("machine", "bf16 GEMM", None, f"{m.gemm} (2 threads, as the demo's worker)"),
        Check("machine", "rollout weights", None, m.rollout),
        Check("machine", "class", None, class_times(demo_class(m))),
    ]


def settings() -> list[Check]:
    """The environment variables and thread counts that change behaviour."""
    rows = []
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows.append(Check("settings", "cpus", None, f"{cpus} usable (os.cpu_count {os.cpu_count()})"))
    try:
        import psutil

        mem = psutil.virtual_memory()
        rows.append(Check("settings", "memory", None, f"{mem.total / 2**30:.1f} GiB, {mem.available / 2**30:.1f} free"))
    except ImportError:
        pass
    if Path("/dev/shm").is_dir():
        shm = shutil.disk_usage("/dev/shm")
        rows.append(Check("settings", "/dev/shm", None, f"{shm.free / 2**30:.1f} GiB free (Ray object store)"))
    try:
        import torch

        rows.append(Check("settings", "torch threads", None, str(torch.get_num_threads())))
    except ImportError:
        pass
    for key in SETTINGS:
        rows.append(Check("settings", key, None, os.environ.get(key, "(unset)")))
    if _version("megatron-core") is not None and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        why = "Megatron with TP/SP communication overlap on GPUs wants CUDA_DEVICE_MAX_CONNECTIONS=1"
        rows.append(Check("settings", "megatron", None if gpus()[0] == 0 else False, why))
    return rows
