"""megatron-core's own `dist_checkpointing` format, written from our rank files (needs megatron-core).

Each of the TP x PP (x EP) workers builds its model chunk(s), loads its rank file (its EP rank's experts), and
takes part in one collective `dist_checkpointing.save` of the sharded state dict. The result is
parallelism-agnostic: megatron-core can load it under another TP/PP/EP (`load_dist_checkpoint`; routed experts
are sharded by their global index, the rest is replicated over EP ranks). Virtual-pipeline chunks are saved
under "model<v>".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlstages.engines.convert.spec import ConversionSpec
from rlstages.engines.megatron.gloo_world import run_world


def save_dist_checkpoint(mcore_dir: str | Path, out_dir: str | Path, timeout: float = 1800.0) -> Path:
    """Write the converted checkpoint in `mcore_dir` as a megatron-core dist checkpoint into `out_dir`."""
    spec = ConversionSpec.load(mcore_dir)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    run_world(
        "rlstages.engines.megatron.dist_ckpt:save_worker",
        spec.tp * spec.pp * spec.ep,
        {"mcore_dir": str(mcore_dir), "out_dir": str(out_dir)},
        timeout=timeout,
    )
    return Path(out_dir)


DIST_CKPT_DIR = "dist_ckpt"  # beside the rank files of a conversion


def dist_checkpoint_writer() -> dict[str, Callable[[Path, Path], Any]]:
    """The `extra_outputs` of `convert_hf_to_mcore` that add a dist checkpoint to a conversion."""
    return {DIST_CKPT_DIR: save_dist_checkpoint}


def sharded_state_dict(chunks: list[Any]) -> dict[str, Any]:
    """The sharded state dict of a rank's model chunks (one chunk: its own; several: "model<v>" keys)."""
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{v}": chunk.sharded_state_dict() for v, chunk in enumerate(chunks)}


def load_dist_checkpoint(chunks: list[Any], ckpt_dir: str | Path) -> None:
    """Load a dist checkpoint into this rank's already built model chunks (any TP/PP layout)."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(sharded_state_dict(chunks), str(ckpt_dir))
    if len(chunks) == 1:
        chunks[0].load_state_dict(state, strict=True)
    else:
        for v, chunk in enumerate(chunks):
            chunk.load_state_dict(state[f"model{v}"], strict=True)


def save_worker(rank: int, world_size: int, port: int, mcore_dir: str, out_dir: str) -> None:
    """One rank of `save_dist_checkpoint`."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from rlstages.engines.convert.hf_to_mcore import load_rank_chunk
    from rlstages.engines.megatron import gpt

    spec = ConversionSpec.load(mcore_dir)
    gpt.init_model_parallel(rank, world_size, port, spec.tp, spec.pp, spec.vpp, ep=spec.ep, etp=spec.expert_tp)
    try:
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        ep_rank = ps.get_expert_model_parallel_rank()
        chunks = []
        for v in range(spec.vpp):
            model = gpt.build_gpt_model(spec, vp_stage=v)
            state = load_rank_chunk(Path(mcore_dir), spec, tp_rank, pp_rank, v, ep_rank)
            model.load_state_dict(state, strict=True)
            chunks.append(model)
        dist_checkpointing.save(sharded_state_dict(chunks), out_dir)
    finally:
        gpt.destroy_model_parallel()
