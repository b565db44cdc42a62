"""Megatron-Core training backend, the parallel plumbing: layout checks, process groups, this rank's model
chunks (loaded from the converted checkpoint, or converted in memory from the HF directory), the critic's
value head, the pipeline schedule, and the HF weight export of a model-parallel group.

Every megatron-core call that hard-codes CUDA runs under `rlstages.engines.megatron.cuda_shim.cuda_as_cpu()`.
Expert parallelism: megatron-core's EP and expert-TP groups (`initialize_model_parallel(expert_model_parallel_size=
..., expert_tensor_parallel_size=...)`) and this rank's experts from the converted checkpoint; context
parallelism (Transformer Engine only) through `megatron.context_parallel`. Non-goals: the loss (`training.core`)
and the optimizer (`megatron.optim`, `megatron.backend`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rlstages.engines import types as T
from rlstages.engines.convert import ConversionSpec, load_rank_chunk, materialize, rank_mcore_to_hf, read_hf_config
from rlstages.engines.convert.sharding import chunk_prefix
from rlstages.engines.megatron import cuda_shim, gpt
from rlstages.engines.models.vision import forward_kwargs
from rlstages.engines.registry import has_module
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.utils import free_port

OUTPUT_LAYER = "output_layer."
VALUE_HEAD_HF = "score."  # HF *ForTokenClassification's head, the torch backend's critic


CP_NEEDS_TE = (
    "context_parallel_size={cp}: megatron-core splits attention over CP ranks only with Transformer Engine "
    "(transformer_engine is not installed); use 1"
)


@dataclass(frozen=True)
class Layout:
    """Parallel sizes of one engine (verl's knobs); `check` rejects what this backend cannot run."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    etp: int | None = None  # expert tensor parallel size; None = tp
    stages: tuple[int | None, int | None] = (None, None)  # uneven (first, last) pipeline stage layers

    def check(self, world_size: int) -> None:
        """Raise on layouts this backend does not implement or that do not divide the world."""
        if self.cp > 1 and not has_module("transformer_engine"):
            raise NotImplementedError(CP_NEEDS_TE.format(cp=self.cp))
        expert_group = self.ep * (self.etp or self.tp) * self.pp
        if world_size % expert_group:
            raise ValueError(
                f"WORLD_SIZE={world_size} is not a multiple of EP x expert TP x PP = {expert_group} "
                "(megatron-core's expert groups)"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")
        if world_size % (self.tp * self.pp * self.cp):
            raise ValueError(
                f"WORLD_SIZE={world_size} is not a multiple of TP x PP x CP = {self.tp * self.pp * self.cp}"
            )


def init_distributed(layout: Layout, seed: int, device: torch.device) -> None:
    """Join the process group from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (default: one local rank)."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    layout.check(world)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT") or free_port())
    gpt.init_model_parallel(
        rank,
        world,
        port,
        layout.tp,
        layout.pp,
        layout.vpp,
        master_addr=addr,
        seed=seed,
        cp=layout.cp,
        ep=layout.ep,
        etp=layout.etp,
        device=device,
    )


def resolve_spec(
    converted_path: str | Path | None, model_path: str | Path, layout: Layout, impl: str
) -> ConversionSpec:
    """The converted checkpoint's spec (it must match the layout), else one built from the HF config."""
    if converted_path is None:
        hf = read_hf_config(Path(model_path))
        first, last = layout.stages
        spec = ConversionSpec.from_hf_config(
            hf, layout.tp, layout.pp, layout.vpp, impl, ep=layout.ep,  # type: ignore[arg-type]
            first_stage_layers=first, last_stage_layers=last, etp=layout.etp,
        )  # fmt: skip
    else:
        spec = ConversionSpec.load(converted_path)
        etp = layout.etp or layout.tp
        here = (spec.tp, spec.pp, spec.vpp, spec.ep, spec.expert_tp, spec.stage_split, spec.transformer_impl)
        if here != (layout.tp, layout.pp, layout.vpp, layout.ep, etp, layout.stages, impl):
            raise ValueError(
                f"{converted_path}: converted for tp={spec.tp} pp={spec.pp} vpp={spec.vpp} ep={spec.ep} "
                f"etp={spec.expert_tp} stages={_stages(spec.stage_split)} ({spec.transformer_impl}), the engine "
                f"runs tp={layout.tp} pp={layout.pp} vpp={layout.vpp} ep={layout.ep} etp={etp} "
                f"stages={_stages(layout.stages)} ({impl}); convert again for this layout (tasks/convert.py)"
            )
    return spec


def _stages(split: tuple[int | None, int | None]) -> str:
    first, last = split
    return "even" if first is None and last is None else f"first={first},last={last}"


def rank_state(
    spec: ConversionSpec,
    converted_path: str | Path | None,
    model_path: str | Path,
    tp_rank: int,
    pp_rank: int,
    ep_rank: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """This rank's state dict per virtual-pipeline chunk (its EP rank's experts): its rank file, or converted in
    memory from HF."""
    if converted_path is not None:
        path = Path(converted_path)
        return [load_rank_chunk(path, spec, tp_rank, pp_rank, v, ep_rank) for v in range(spec.vpp)]
    from rlstages.engines.convert.hf_to_mcore import hf_weight_files, stream_rank_tensors
    from rlstages.engines.convert.safetensors_io import Reader

    chunks: list[dict[str, torch.Tensor]] = [{} for _ in range(spec.vpp)]
    readers = [Reader(f, use_mmap=False) for f in hf_weight_files(Path(model_path))]
    for t, p, name, shard in stream_rank_tensors(spec, readers, ep_rank=ep_rank):
        if (t, p) != (tp_rank, pp_rank):
            continue
        v = next(v for v in range(spec.vpp) if name.startswith(chunk_prefix(v, spec.vpp)))
        chunks[v][name[len(chunk_prefix(v, spec.vpp)) :]] = materialize(shard)
    return chunks


class ValueHead(torch.nn.Module):
    """The critic's [hidden, 1] head in place of GPTModel's output layer (replicated over TP ranks)."""

    def __init__(self, hidden: int, std: float, seed: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.score = torch.nn.Linear(hidden, 1, dtype=dtype)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.score.weight.copy_(torch.randn(1, hidden, generator=gen) * std)
            self.score.bias.zero_()

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None) -> tuple:
        """GPTModel's output-layer call: [S, B, H] -> ([S, B, 1], None)."""
        return self.score(hidden), None


def build_chunks(
    spec: ConversionSpec,
    states: list[dict[str, torch.Tensor]],
    role: str,
    dtype: torch.dtype,
    config: dict,
    seed: int,
    device: torch.device,
) -> list[Any]:
    """This rank's GPTModel chunks with their weights, on the worker's device (megatron-core builds the local
    spec's torch norms on the CPU even on a GPU); the critic's output layer becomes a `ValueHead`."""
    if role == "critic":
        spec = replace(spec, mcore={**spec.mcore, "share_embeddings_and_output_weights": False})
    chunks = []
    for v, state in enumerate(states):
        model = gpt.build_gpt_model(spec, dtype=dtype, vp_stage=v, config_overrides=config)
        model.to(device=device, dtype=dtype)  # torch norms ignore params_dtype and the device; one of each
        if role != "critic":
            model.load_state_dict(state, strict=True)
        else:
            state = {k: t for k, t in state.items() if not k.startswith(OUTPUT_LAYER)}
            if model.post_process:
                std = float(spec.hf_config.get("initializer_range", 0.02))
                model.output_layer = ValueHead(spec.mcore["hidden_size"], std, seed, dtype).to(device)
            missing, unexpected = model.load_state_dict(state, strict=False)
            if unexpected or [k for k in missing if not k.startswith(OUTPUT_LAYER)]:
                raise ValueError(f"critic weights do not fit: missing {missing}, unexpected {unexpected}")
        chunks.append(model)
    return chunks


def model_inputs(mb: TensorDict, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, position ids and the boolean causal+padding mask [B, 1, S, S] (True = masked) of a
    left-padded micro-batch, right-padded to a multiple of `multiple` (sequence parallelism)."""
    ids = torch.cat([mb[T.PROMPT_IDS], mb[T.RESPONSE_IDS]], dim=1)
    valid, pos = mb[T.ATTENTION_MASK].bool(), mb[T.POSITION_IDS]
    pad = -ids.shape[1] % multiple
    if pad:
        ids = torch.nn.functional.pad(ids, (0, pad))
        valid = torch.nn.functional.pad(valid, (0, pad), value=False)
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device)], dim=1)
    batch, seq = ids.shape
    mask = gpt.causal_mask(seq, batch, ids.device) | ~valid[:, None, None, :]
    return ids, pos, mask


def pad_positions(positions: torch.Tensor, length: int) -> torch.Tensor:
    """Positions [..., S] right-padded to `length` with their last value (the padding that `model_inputs` adds for
    sequence parallelism: masked tokens, their positions unused)."""
    extra = length - positions.shape[-1]
    return torch.cat([positions, positions[..., -1:].expand(*positions.shape[:-1], extra)], -1) if extra else positions


ForwardFn = Callable[[TensorDict, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def run_schedule(models: list[Any], mbs: list[TensorDict], loss_fn: ForwardFn, forward_only: bool, tp: int) -> None:
    """megatron-core's forward(-backward) schedule over the micro-batches (1F1B / interleaved when PP > 1).

    `loss_fn(mb, output)` runs on the last pipeline stage with the model's output ([B, S, V] gathered logits,
    or [B, S, 1] values) and returns (loss, token count); the loss is used as is (no averaging). An image
    micro-batch also passes its pixel values, image grids and M-RoPE positions (`vlm_model.QwenVLModel`).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not mbs:
        return
    multiple = tp if models[0].config.sequence_parallel else 1

    def forward_step(data: Iterator[TensorDict], model: Any) -> tuple[torch.Tensor, Callable]:
        mb = next(data)
        if model.config.context_parallel_size > 1:
            out = _cp_forward(model, mb, multiple)
        else:
            ids, pos, mask = model_inputs(mb, multiple)
            images = forward_kwargs(mb, ids.device)  # an image batch: pixel values, grids, M-RoPE positions [3, B, S]
            pos = pad_positions(images.pop("position_ids"), ids.shape[1]) if images else pos
            out = model(input_ids=ids, position_ids=pos, attention_mask=mask, runtime_gather_output=True, **images)

        def loss(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            value, tokens = loss_fn(mb, output)
            return value, tokens, {}

        return out, loss

    longest = max(int(mb[T.ATTENTION_MASK].shape[1]) for mb in mbs)
    cp = models[0].config.context_parallel_size
    padded = multiple * (2 * cp if cp > 1 else 1)  # with CP: each rank holds 2 of 2 x CP chunks of the sequence
    data = [iter(mbs) for _ in models] if len(models) > 1 else iter(mbs)
    with cuda_shim.cuda_as_cpu():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=models if len(models) > 1 else models[0],
            num_microbatches=len(mbs),
            seq_length=(longest + (-longest % padded)) // cp,
            micro_batch_size=max(mb.batch_size[0] for mb in mbs),
            forward_only=forward_only,
        )


def _cp_forward(model: Any, mb: TensorDict, multiple: int) -> torch.Tensor:
    """This CP rank's share of the micro-batch through the model (TE causal attention, no explicit mask); on
    the last stage the output gathered over the CP group back to [B, S, ...] (`megatron.context_parallel`)."""
    from megatron.core import parallel_state as ps

    from rlstages.engines.megatron import context_parallel as CP

    ids = torch.cat([mb[T.PROMPT_IDS], mb[T.RESPONSE_IDS]], dim=1)
    valid = mb[T.ATTENTION_MASK].bool()
    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    part = CP.split_for_rank(ids, mb[T.POSITION_IDS], valid, cp, rank, multiple)
    out = model(
        input_ids=part.input_ids, position_ids=part.position_ids, attention_mask=None, runtime_gather_output=True
    )
    if not model.post_process:
        return out
    return CP.gather_output(out, part, ids.shape[1], ps.get_context_parallel_group())


def is_last_stage() -> bool:
    """This rank holds the last pipeline stage (where outputs and losses live)."""
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True)


def share_from_last_stage(obj: Any) -> Any:
    """Broadcast a picklable object from the last pipeline stage to the other stages of this pipeline."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    group = ps.get_pipeline_model_parallel_group()
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
    return box[0]


def export_hf(chunks: list[Any], spec: ConversionSpec, role: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF-named full tensor, on every rank of the model-parallel group (a collective: all its ranks
    iterate together). TP shards are all-gathered inside each stage (`rank_mcore_to_hf`); with PP > 1 each
    stage's tensors are broadcast over the pipeline group, stage by stage, one tensor at a time."""
    from megatron.core import parallel_state as ps

    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    group = ps.get_pipeline_model_parallel_group()
    for stage in range(pp):
        src = torch.distributed.get_global_rank(group, stage) if pp > 1 else 0
        if stage == pp_rank:
            for name, tensor in _stage_hf(chunks, spec, role, pp_rank):
                if pp > 1:
                    torch.distributed.broadcast_object_list([(name, tensor.shape, tensor.dtype)], src=src, group=group)
                    torch.distributed.broadcast(tensor.contiguous(), src=src, group=group)
                yield name, tensor
            if pp > 1:
                torch.distributed.broadcast_object_list([None], src=src, group=group)
            continue
        while True:
            box: list[Any] = [None]
            torch.distributed.broadcast_object_list(box, src=src, group=group)
            if box[0] is None:
                break
            name, shape, dtype = box[0]
            tensor = torch.empty(shape, dtype=dtype, device=_device(chunks))
            torch.distributed.broadcast(tensor, src=src, group=group)
            yield name, tensor


def _stage_hf(chunks: list[Any], spec: ConversionSpec, role: str, pp_rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    experts = {}  # routed experts: TP shards over the expert-TP group, local experts of every EP rank
    if spec.num_experts:
        experts = {
            "ep_group": ps.get_expert_model_parallel_group(),
            "expert_tp_group": ps.get_expert_tensor_parallel_group(),
        }
    if role == "critic":  # the backbone exports like a tied model (no lm_head); the value head is added below
        spec = replace(spec, mcore={**spec.mcore, "share_embeddings_and_output_weights": True})
    for v, chunk in enumerate(chunks):
        state = {k: t for k, t in chunk.state_dict().items() if not (role == "critic" and k.startswith(OUTPUT_LAYER))}
        yield from rank_mcore_to_hf(state.items(), spec, pp_rank=pp_rank, vp_stage=v, tp_group=tp_group, **experts)
        if role == "critic" and isinstance(getattr(chunk, "output_layer", None), ValueHead):
            for name, tensor in chunk.output_layer.score.state_dict().items():
                yield VALUE_HEAD_HF + name, tensor.detach()


def _device(chunks: list[Any]) -> torch.device:
    return next(chunks[0].parameters()).device
