"""Megatron-Core process groups and a GPTModel built from a ConversionSpec (any TP/PP/VPP).

Shared by the conversion parity gate, the dist-checkpoint writer and the Megatron training backend.
megatron-core is imported inside the functions: importing this module never needs it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rlstages.engines.convert.spec import ConversionSpec
from rlstages.engines.imports import import_object
from rlstages.engines.megatron.cuda_shim import (
    apply_cpu_shim,
    apply_moe_shim,
    apply_torch_norm_sp_shim,
    computes_on_cuda,
)
from rlstages.engines.runtime.device import dist_backend, worker_device

# Fusions that need CUDA kernels (apex / TE / torch.compile'd CUDA code); off on CPU.
CPU_SAFE_CONFIG: dict[str, Any] = {
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "masked_softmax_fusion": False,
    "persist_layer_norm": False,
    "gradient_accumulation_fusion": False,
    "use_cpu_initialization": True,
}


def init_model_parallel(
    rank: int,
    world_size: int,
    master_port: int,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    *,
    master_addr: str = "127.0.0.1",
    seed: int = 1234,
    backend: str | None = None,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    device: torch.device | None = None,
) -> None:
    """Join a process group (gloo on CPU; on a GPU `cpu:gloo,cuda:nccl`, the worker's GPU made current first)
    and set up megatron-core's TP x PP (x CP x EP) groups on `device`, the worker's (None: a process with no
    engine, a conversion or parity worker, starts here and resolves its own).
    `etp` is the expert tensor-parallel size (None: TP, megatron-core's default).

    In a process that already has the same layout (several engines in one test process) the groups are kept;
    a different layout is rebuilt only in a single-process world.
    """
    from megatron.core import parallel_state, tensor_parallel

    if device is None:
        device = worker_device()  # torch.cuda.set_device before NCCL or megatron-core touches a GPU
    cpu = apply_cpu_shim(device)
    apply_moe_shim()  # MoE layers without Transformer Engine / CUDA (any EP size)
    apply_torch_norm_sp_shim()  # sequence parallelism with torch norms (no Transformer Engine / Apex)
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    fresh = not torch.distributed.is_initialized()
    if fresh:
        torch.distributed.init_process_group(
            backend or dist_backend(device),
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
        )
        if parallel_state.model_parallel_is_initialized():  # groups of a world destroyed without them: stale
            parallel_state.destroy_model_parallel()
    vpp = vpp if vpp and vpp > 1 else None
    if parallel_state.model_parallel_is_initialized():
        current = _layout_now()
        if current == (tp, pp, vpp, cp, ep, etp or tp):
            tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=cpu)
            return
        if torch.distributed.get_world_size() > 1:
            raise RuntimeError(f"megatron-core groups already built for (tp, pp, vpp, cp, ep, etp)={current}")
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tp, pp, vpp, context_parallel_size=cp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=cpu)


def _layout_now() -> tuple[int, int, int | None, int, int, int]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_virtual_pipeline_model_parallel_world_size(),
        ps.get_context_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_world_size(),
    )


def destroy_model_parallel() -> None:
    """Tear down megatron-core's groups and the default process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def make_transformer_config(spec: ConversionSpec, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """A megatron-core TransformerConfig from the spec (CPU-safe flags on a CPU worker) plus overrides;
    MoE / MLA specs get their config class and fields from `moe_model`."""
    from rlstages.engines.megatron import moe_model

    config_cls = moe_model.transformer_config_class(spec)
    kwargs = spec.transformer_kwargs()
    kwargs.update(moe_model.moe_config_kwargs(spec, computes_on_cuda()))
    kwargs.update(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp if spec.vpp > 1 else None,
        params_dtype=dtype,
        pipeline_dtype=dtype,
    )
    kwargs.update(spec.pipeline_config())  # uneven first / last stage: megatron-core's layer offsets
    if not computes_on_cuda():
        kwargs.update(CPU_SAFE_CONFIG)
    kwargs.update(overrides)
    return config_cls(**kwargs)


def layer_spec(spec: ConversionSpec) -> Any:
    """The GPT layer spec the converted names were written for (local, or Transformer Engine)."""
    from megatron.core.models.gpt import gpt_layer_specs

    args = {"qk_layernorm": bool(spec.mcore.get("qk_layernorm")), "normalization": spec.mcore.get("normalization")}
    if spec.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args["qk_layernorm"])
    return gpt_layer_specs.get_gpt_layer_local_spec(**args)


def build_gpt_model(
    spec: ConversionSpec,
    *,
    dtype: torch.dtype = torch.float32,
    vp_stage: int | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> Any:
    """The GPTModel (or the template's registered subclass) of this rank's pipeline stage / chunk. A subclass with a
    `spec_kwargs(spec) -> dict` classmethod gets those keyword arguments too (e.g. the HF config for a vision tower).

    Call after `init_model_parallel(..., tp=spec.tp, pp=spec.pp, vpp=spec.vpp)`.
    """
    from megatron.core import parallel_state

    config = make_transformer_config(spec, dtype, **(config_overrides or {}))
    vpp = spec.vpp if spec.vpp > 1 else None
    stage = vp_stage if vpp else None
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
    from rlstages.engines.megatron import moe_model

    if moe_model.is_moe_or_mla(spec):
        return moe_model.build_moe_gpt_model(spec, config, model_class(spec), pre, post, stage)
    cls = model_class(spec)
    extra = cls.spec_kwargs(spec) if hasattr(cls, "spec_kwargs") else {}  # a subclass's own arguments
    return cls(
        config=config,
        transformer_layer_spec=layer_spec(spec),
        pre_process=pre,
        post_process=post,
        vp_stage=stage,
        **spec.gpt_model_kwargs(),
        **extra,
    )


def model_class(spec: ConversionSpec) -> type:
    """GPTModel, or the "module:Class" subclass named by the template's `mcore_model_cls`."""
    name = spec.template.mcore_model_cls
    if not name:
        from megatron.core.models.gpt import GPTModel

        return GPTModel
    return import_object(name, "mcore_model_cls", expected="ClassName")


def causal_mask(seq_len: int, batch: int = 1, device: torch.device | None = None) -> torch.Tensor:
    """Boolean attention mask [batch, 1, S, S] on `device`, True where attention is masked (future positions)."""
    mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)
    return mask.expand(batch, 1, seq_len, seq_len)
