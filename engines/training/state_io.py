"""Checkpoint I/O without pickle: model weights, optimizer, scheduler and RNG states as safetensors + JSON.

Every file is written to a temporary name and renamed, so a crash never leaves a half-written file.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlstages.engines.runtime.device import on_cuda
from rlstages.engines.utils import atomic_write_text

__all__ = ["atomic_write_text"]

MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
EXTRA_FILE = "trainer_state.json"
RNG_FILE = "rng.safetensors"


def rank_rng_file(rank: int) -> str:
    """The RNG file of one rank of a multi-rank backend (DeepSpeed, Megatron)."""
    return f"rng_rank{rank}.safetensors"


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Safetensors save via a temp file; shared storage is cloned so tied weights save cleanly."""
    tmp = path.with_name(path.name + ".tmp")
    clean = {
        k: v.detach().contiguous().clone() if _shares(v, tensors) else v.detach().contiguous()
        for k, v in tensors.items()
    }
    save_file(clean, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def tied_aliases(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each key whose tensor is the very view of an earlier key's (tied weights: one parameter under two names,
    e.g. a tied `lm_head.weight`) -> that earlier key; a checkpoint stores the tensor once."""
    first: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for key, t in tensors.items():
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if view in first:
            aliases[key] = first[view]
        else:
            first[view] = key
    return aliases


def _shares(t: torch.Tensor, all_tensors: dict[str, torch.Tensor]) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return sum(1 for v in all_tensors.values() if v.untyped_storage().data_ptr() == ptr) > 1


def save_optimizer(optim: torch.optim.Optimizer, path: Path) -> None:
    """Flatten an optimizer state dict into tensors (safetensors) and param groups (JSON metadata)."""
    state = optim.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value
            else:
                scalars[f"{idx}.{key}"] = value
    groups = [{k: v.item() if isinstance(v, torch.Tensor) else v for k, v in g.items()} for g in state["param_groups"]]
    meta = {"param_groups": json.dumps(groups), "scalars": json.dumps(scalars)}
    if not tensors:
        tensors["__empty__"] = torch.zeros(0)
    save_tensors(tensors, path, meta)


def load_optimizer(optim: torch.optim.Optimizer, path: Path) -> None:
    """Inverse of `save_optimizer`."""
    from safetensors import safe_open

    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key == "__empty__":
            continue
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    for key, value in json.loads(meta.get("scalars", "{}")).items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    groups = json.loads(meta["param_groups"])
    for g, current in zip(groups, optim.param_groups, strict=True):
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        for key, value in current.items():  # an optimizer that keeps lr as a tensor (torchao's did)
            if isinstance(value, torch.Tensor) and key in g:
                g[key] = torch.tensor(g[key], dtype=value.dtype)
    optim.load_state_dict({"state": state, "param_groups": groups})


def save_rng(path: Path) -> None:
    """RNG states of torch (and of this GPU, once CUDA is in use), numpy and Python."""
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # legacy=True (the default): the MT19937 tuple
    meta = {
        "python": json.dumps(_jsonable(random.getstate())),
        "numpy": json.dumps([np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])]),
    }
    tensors = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64))}
    if torch.cuda.is_initialized():  # sampling and dropout on a GPU draw from its generator
        tensors["cuda"] = torch.cuda.get_rng_state()
    save_tensors(tensors, path, meta)


def load_rng(path: Path, device: torch.device) -> None:
    """Inverse of `save_rng`, in a worker computing on `device` (the CUDA generator only there)."""
    from safetensors import safe_open

    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and on_cuda(device):
        torch.cuda.set_rng_state(tensors["cuda"])
    name, pos, has_gauss, cached = json.loads(meta["numpy"])
    np.random.set_state((name, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(internal), gauss))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, tuple | list):
        return [_jsonable(o) for o in obj]
    return obj
