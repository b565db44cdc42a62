"""Megatron-Core step backend: actor, critic (value head) or frozen reference under TP / PP (+VPP) / DP.

Each Ray rank (RANK / WORLD_SIZE / MASTER_* from the actor group) joins one process group, builds its
GPTModel chunk(s) and loads its own shard of the converted checkpoint (`settings.converted_path`; critic and
reference, which get none, convert the HF directory in memory). `PPOTrainer` drives it: micro-batches run
through megatron-core's schedule (`parallel.run_schedule`; 1F1B when PP > 1) with the trainer's callback as
the loss function on the last pipeline stage, where the response log-probs are read from the TP-gathered
logits at the same positions as `ppo_step.causal_lm_forward`. Gradients are reduced by megatron's DDP
(mean over data-parallel ranks), the update is megatron's optimizer (torch AdamW inside, or the distributed
optimizer), clipped at `optim.grad_clip` and skipped on a non-finite norm, with `training.optim.lr_lambda`
as the schedule.

Offload mapping (megatron-core 0.16): `optimizer_offload` -> OptimizerConfig.optimizer_cpu_offload with
`optimizer_offload_fraction = offload_fraction` (HybridDeviceOptimizer); `grad_offload` -> DDP
offload/restore_grad_buffers around each train step; `param_offload` -> the DDP param buffers'
offload_to_cpu/reload_from_cpu around every call. Without CUDA all three are no-ops (everything already
lives in host memory; logged once). Collectives: `named_weights`, `weight_buckets`, `save_pretrained`,
`save` and `load` must be called on every rank of the model-parallel group at once.

Mixture-of-Experts (`megatron.moe`): experts split over `expert_model_parallel_size` ranks (each loads its
own experts from the converted checkpoint), tokens routed by megatron's alltoall (or allgather) dispatcher,
expert gradients reduced by megatron's DDP over the expert-data-parallel group, router options from
`options.moe`, `moe/*` metrics every train step. Context parallelism only with Transformer Engine
(`megatron.context_parallel`; refused without it).

Uneven pipeline stages (`num_layers_in_first/last_pipeline_stage`) go to megatron-core's TransformerConfig and to
the converter's layer map alike (`ConversionSpec.first_stage_layers`), so each stage loads the layers it builds.

Vision-language models (the `qwen2_vl` / `qwen2_5_vl` templates, `megatron.vlm_model.QwenVLModel`): an image
micro-batch passes its pixel values, image grids and M-RoPE positions to every chunk (`parallel.run_schedule`), the
log-probs take the vision tokens out of the distribution as the torch backend does, and `freeze` / `optim.group_lr`
act on the parts (`vlm_model.split_parts`, `optim.build_optimizer`).

Sequence parallelism runs with torch norms too (`cuda_shim.apply_torch_norm_sp_shim`); an MoE model under TP > 1
always runs with it (megatron-core trains MoE layers under TP only so). Non-goals: float16 and bf16_autocast (use
dtype bfloat16); without CUDA also activation recompute.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from rlstages.configs.megatron_training import UNEVEN_VPP_NEEDS_MIDDLE, MegatronTrainingConfig
from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.base import OnOutput, Readout
from rlstages.engines.megatron import cuda_shim
from rlstages.engines.megatron import moe as MOE
from rlstages.engines.megatron import optim as MO
from rlstages.engines.megatron import parallel as MP
from rlstages.engines.models import torch_dtype
from rlstages.engines.models.vision import suppress, vision_token_ids
from rlstages.engines.registry import has_module
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.training import state_io
from rlstages.engines.training.optim import lr_lambda
from rlstages.engines.training.settings import TrainerSettings

log = logging.getLogger(__name__)
CKPT_DIR = "mcore"  # megatron-core dist checkpoint (model + optimizer), relative to the `save` directory


def check_supported(settings: TrainerSettings, options: MegatronTrainingConfig, device: torch.device) -> None:
    """Refuse what this backend cannot run on `device`, before any process group starts."""
    if settings.dtype == "float16":
        raise NotImplementedError("megatron backend: dtype float16 needs loss scaling; use bfloat16 or float32")
    if settings.train.bf16_autocast:
        raise NotImplementedError(
            "megatron backend: bf16_autocast is not supported (megatron's linear layers have no autocast "
            "backward); use dtype: bfloat16 (bf16 weights, fp32 main params in megatron's optimizer)"
        )
    if settings.train.gradient_checkpointing and device.type != "cuda":
        raise NotImplementedError("megatron activation recompute saves CUDA RNG state: it needs a GPU")
    if options.transformer_impl == "transformer_engine" and not has_module("transformer_engine"):
        raise ImportError("transformer_impl='transformer_engine' needs transformer_engine (GPU); use 'local'")
    if options.context_parallel_size > 1 and not has_module("transformer_engine"):
        raise NotImplementedError(MP.CP_NEEDS_TE.format(cp=options.context_parallel_size))
    both = options.num_layers_in_first_pipeline_stage and options.num_layers_in_last_pipeline_stage
    if both and options.virtual_pipeline_model_parallel_size and options.pipeline_model_parallel_size == 2:
        raise NotImplementedError(UNEVEN_VPP_NEEDS_MIDDLE)
    if options.moe.token_dispatcher == "allgather" and options.pipeline_model_parallel_size > 1:
        raise ValueError(
            "megatron moe.token_dispatcher=allgather does not take variable sequence lengths, which pipeline "
            "parallelism uses here; use alltoall"
        )


class MegatronBackend:
    """One rank of a Megatron-Core model and optimizer; implements `rlstages.engines.base.StepBackend`."""

    keeps_weights = False  # named_weights converts gathered shards into fresh HF tensors, one at a time
    # Set before CUDA starts (`PPOTrainer` applies it unless the user's env has it): megatron-core's TP / SP
    # overlap of communication with compute relies on kernels being issued in order on one connection.
    cuda_env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}

    def __init__(self, settings: TrainerSettings) -> None:
        options = settings.train
        if not isinstance(options, MegatronTrainingConfig):  # a reference gets the defaults
            options = MegatronTrainingConfig()
        self.device = settings.resolved_device()  # chunks and micro-batches live here (`parallel.build_chunks`)
        check_supported(settings, options, self.device)
        self.settings, self.role = settings, settings.role
        self.layout = MP.Layout(
            options.tensor_model_parallel_size,
            options.pipeline_model_parallel_size,
            options.virtual_pipeline_model_parallel_size or 1,
            options.context_parallel_size,
            options.expert_model_parallel_size,
            options.sequence_parallel,
            options.expert_tensor_parallel_size,
            (options.num_layers_in_first_pipeline_stage, options.num_layers_in_last_pipeline_stage),
        )
        MP.init_distributed(self.layout, settings.seed, self.device)
        from megatron.core import parallel_state as ps

        converted = settings.converted_path
        self.options = options
        self.spec = MP.resolve_spec(converted, settings.model_path, self.layout, options.transformer_impl)
        if settings.model_type is not None and settings.model_type != self.spec.template.hf_model_type:
            raise ValueError(
                f"model_type={settings.model_type!r} but the checkpoint is {self.spec.template.hf_model_type!r}"
            )
        self.converted_path = Path(converted) if converted is not None else None
        self.vision_ids = vision_token_ids(SimpleNamespace(**self.spec.hf_config))  # [] for a text model
        self.rank, self.tp_rank = torch.distributed.get_rank(), ps.get_tensor_model_parallel_rank()
        self.dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        self.dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        self.dtype = torch_dtype(settings.dtype)
        pp_rank, ep_rank = ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        states = MP.rank_state(self.spec, converted, settings.model_path, self.tp_rank, pp_rank, ep_rank)
        self.chunks = MP.build_chunks(
            self.spec, states, self.role, self.dtype, self._config_overrides(), settings.seed, self.device
        )
        del states
        self.expert_load = MOE.ExpertLoad(self.chunks) if self.is_moe else None
        self.offload = {
            "param": options.param_offload,
            "grad": options.grad_offload,
            "optimizer": options.optimizer_offload,
        }
        if any(self.offload.values()) and self.device.type != "cuda":
            log.info(
                "megatron offload %s: no-ops without CUDA (weights/grads/states already in host memory)", self.offload
            )
        self.optimizer: Any = None
        if settings.trainable and self.vision_ids:  # a vision-language model: its parts frozen or at their own LR
            from rlstages.engines.megatron.vlm_model import split_parts

            split_parts(self.chunks, options.freeze)
        if not settings.trainable:
            for chunk in self.chunks:
                chunk.requires_grad_(False).eval()
            self.models = list(self.chunks)
        else:
            self.models = self._wrap_ddp(options.use_distributed_optimizer)
            offload = (options.optimizer_offload and self.device.type == "cuda", options.offload_fraction)
            self.optimizer = MO.build_optimizer(
                self.models, settings.optim, self.dtype, options.use_distributed_optimizer, *offload
            )
        self.lr_factor = lr_lambda(settings.optim, settings.optim_steps)
        self.sched_steps = 0  # optimizer steps taken (the LR schedule's position)

    def _config_overrides(self) -> dict[str, Any]:
        lay = self.layout
        config: dict[str, Any] = {
            "calculate_per_token_loss": True,  # our losses are already normalised: the schedule must not divide
            # megatron-core trains an MoE layer under TP > 1 only with the sequence split over the TP ranks (each
            # rank routes its own tokens; without it every TP rank would send the same tokens to the experts)
            "sequence_parallel": lay.sequence_parallel or (self.is_moe and lay.tp > 1),
            "context_parallel_size": lay.cp,
            "expert_model_parallel_size": lay.ep,
            "bf16": self.dtype == torch.bfloat16,
        }
        if lay.pp > 1:  # micro-batches are trimmed to their own length: pipeline sends carry their shapes
            config.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
            # gloo: with 2 stages next == prev, and batched p2p ops (one communicator, both directions at once
            # under VPP) pair an activation with a gradient of the same shape; unbatched ops use two groups.
            config.update(batch_p2p_comm=self.device.type == "cuda")
        if self.settings.train.gradient_checkpointing:
            config.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if self.is_moe:
            config.update(MOE.config_overrides(self.options, lay.tp))
        return config

    @property
    def is_moe(self) -> bool:
        """The model has routed experts (megatron's num_moe_experts)."""
        return bool(self.spec.mcore.get("num_moe_experts"))

    def _wrap_ddp(self, distributed_optimizer: bool) -> list[Any]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
        )
        return [DistributedDataParallel(c.config, ddp, c, disable_bucketing=v > 0) for v, c in enumerate(self.chunks)]

    # ---- forward / backward ---------------------------------------------------------------------------------
    @property
    def outputs_here(self) -> bool:
        """Outputs and losses live on the last pipeline stage."""
        return MP.is_last_stage()

    def _read(self, output: torch.Tensor, mb: TensorDict, readout: Readout) -> tuple[torch.Tensor, ...]:
        """The readout from full-vocab logits [B, S, V_padded] (or values [B, S, 1]) of the response tokens."""
        start, width = mb[T.PROMPT_IDS].shape[1] - 1, mb[T.RESPONSE_IDS].shape[1]
        if readout.values:
            return (output[:, start : start + width, 0].float(),)
        logits = output[:, start : start + width, : self.spec.hf_vocab_size].float() / readout.temperature
        if T.ROPE_POSITION_IDS in mb.keys():  # an image batch: vision tokens out of the distribution, as the rollout
            logits = suppress(logits, self.vision_ids)
        logp = A.logprobs_from_logits(logits, mb[T.RESPONSE_IDS])
        with torch.set_grad_enabled(readout.entropy_grad and torch.is_grad_enabled()):
            entropy = A.entropy_from_logits(logits)
        return logp, entropy

    def run(self, mbs: list[TensorDict], readout: Readout, on_output: OnOutput, train: bool) -> None:
        """The micro-batches through megatron's schedule; when training, DDP-reduce the gradients after."""
        from megatron.core.distributed import finalize_model_grads

        def loss_fn(mb: TensorDict, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            loss = on_output(mb, self._read(output, mb, readout))
            if loss is None:
                return output.new_zeros(()), torch.zeros((), dtype=torch.int, device=output.device)
            return loss, mb[T.RESPONSE_MASK].sum().int()

        if train:
            for model in self.models:
                model.zero_grad_buffer()
            self.optimizer.zero_grad()
        if self.expert_load is not None:
            self.expert_load.reset()
            self.microbatches = len(mbs)
        tokens = sum(mb[T.ATTENTION_MASK].numel() for mb in mbs)  # routed tokens of this rank, pads included
        scale = MOE.aux_loss_scale(1.0 / max(1, tokens)) if self.is_moe else contextlib.nullcontext()
        with scale:
            MP.run_schedule(self.models, mbs, loss_fn, not train, self.layout.tp)
        if not train:
            return
        with cuda_shim.cuda_as_cpu():
            finalize_model_grads(self.models)  # DP reduce, sequence-parallel norms, tied embeddings over PP
        if self.dp > 1:  # per-token loss mode sums over DP ranks; average them as the other backends do
            for model in self.models:
                model.scale_gradients(1.0 / self.dp)

    def share(self, metrics: dict[str, float]) -> dict[str, float]:
        """The last stage's metrics on every stage of the pipeline, with the `moe/*` ones of an MoE model."""
        if self.expert_load is not None:  # a collective: every rank of a train step gets here
            names = MOE.tracked_losses(self.options)
            moe = MOE.step_metrics(self.expert_load, names, self.microbatches, self.spec.mcore["num_layers"])
        shared: dict[str, float] = MP.share_from_last_stage(metrics)
        return {**shared, **moe} if self.expert_load is not None else shared

    def optimizer_step(self) -> float:
        """Set this step's LR, clip, step (skipped on a non-finite norm)."""
        lr = self.settings.optim.lr * self.lr_factor(self.sched_steps)
        grad_norm = MO.optimizer_step(self.optimizer, self.settings.optim, lr)
        self.sched_steps += 1
        return grad_norm

    def lr(self) -> float:
        """The LR of the next optimizer step."""
        return self.settings.optim.lr * self.lr_factor(self.sched_steps)

    @contextlib.contextmanager
    def resident(self, train: bool) -> Iterator[None]:
        """On a GPU, bring offloaded params (and grads for training) back for the call and offload them after."""
        gpu = self.device.type == "cuda" and self.role != "reference"
        buffers = [b for m in self.models for b in getattr(m, "buffers", [])] if gpu else []
        for b in buffers if self.offload["param"] else []:
            b.reload_from_cpu(move_params=True, move_grads=False)
        grads = gpu and train and self.offload["grad"]
        for m in self.models if grads else []:
            m.restore_grad_buffers()
        try:
            yield
        finally:
            for m in self.models if grads else []:
                m.offload_grad_buffers()
            for b in buffers if self.offload["param"] else []:
                b.offload_to_cpu(move_params=True, move_grads=False)

    # ---- weights and state ----------------------------------------------------------------------------------
    @property
    def is_weight_source(self) -> bool:
        """TP rank 0 of the last pipeline stage of DP replica 0 (the actor group's `collect_ranks()[0]`):
        where `weight_buckets` yields and `save_pretrained` writes."""
        return self.dp_rank == 0 and self.tp_rank == 0 and MP.is_last_stage()

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF-named full tensor on every rank (a collective over the model-parallel group: all its ranks
        iterate together). Tensors may share storage with the live parameters; clone to keep them."""
        with self.resident(train=False):
            yield from MP.export_hf(self.chunks, self.spec, self.role)

    def save_hf(self, path: Path) -> bool:
        """An HF directory (config, safetensors) written by the weight source; every rank joins the gathers."""
        source = self.is_weight_source
        weights = {name: tensor.detach().clone() for name, tensor in self.named_weights() if source}
        if not source:
            return False
        path.mkdir(parents=True, exist_ok=True)
        side = self.converted_path / "hf" if self.converted_path is not None else None
        for f in side.iterdir() if side is not None and side.is_dir() else []:
            shutil.copy2(f, path / f.name)
        config = dict(self.spec.hf_config)
        if self.role == "critic":
            arch = str((config.get("architectures") or ["ForCausalLM"])[0])
            config.update(architectures=[arch.replace("ForCausalLM", "ForTokenClassification")])
            config.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        (path / "config.json").write_text(json.dumps(config, indent=2))
        state_io.save_tensors(weights, path / state_io.MODEL_FILE, {"format": "pt"})
        return True

    def _sharded_state(self, loading: bool) -> dict[str, Any]:
        from rlstages.engines.megatron.dist_ckpt import sharded_state_dict

        state: dict[str, Any] = {"model": sharded_state_dict(self.chunks)}
        if self.optimizer is not None:
            if loading:
                MO.init_adam_state(self.optimizer)
            with cuda_shim.cuda_as_cpu(), MO.steps_for_empty_optimizers(self.optimizer):
                state["optimizer"] = self.optimizer.sharded_state_dict(
                    state["model"], is_loading=loading, metadata=MO.OPTIM_METADATA
                )
        return state

    def save(self, path: Path, steps_done: int) -> None:
        """megatron-core dist checkpoint of model + optimizer under `path/mcore` (every rank writes its shards),
        the schedule position (rank 0) and each rank's RNG state. Call on every rank with a shared `path`."""
        from megatron.core import dist_checkpointing

        (path / CKPT_DIR).mkdir(parents=True, exist_ok=True)
        with self.resident(train=False):
            dist_checkpointing.save(self._sharded_state(loading=False), str(path / CKPT_DIR))
        if self.rank == 0:
            extra = {"steps_done": steps_done, "sched_steps": self.sched_steps, "optim": self.settings.optim_record()}
            state_io.atomic_write_text(path / state_io.EXTRA_FILE, json.dumps(extra))
        state_io.save_rng(path / state_io.rank_rng_file(self.rank))
        torch.distributed.barrier()

    def load(self, path: Path) -> int | None:
        """Restore what `save` wrote (every rank; the data-parallel, expert-parallel and tensor-parallel sizes
        may differ: weights and optimizer state reshard; a rank the saver did not have keeps its RNG state)."""
        from megatron.core import dist_checkpointing

        with self.resident(train=False):
            state = dist_checkpointing.load(self._sharded_state(loading=True), str(path / CKPT_DIR))
            models = state["model"]
            for v, chunk in enumerate(self.chunks):
                chunk.load_state_dict(models if len(self.chunks) == 1 else models[f"model{v}"], strict=True)
            if self.optimizer is not None:
                optimizer_state = MO.fit_loaded_state(self.optimizer, state["optimizer"])  # EP changed: refit
                with cuda_shim.cuda_as_cpu(), torch.no_grad(), MO.keep_adam_steps(self.optimizer):
                    self.optimizer.load_state_dict(optimizer_state)
                MO.restore_adam_steps(self.optimizer)
        extra = json.loads((path / state_io.EXTRA_FILE).read_text())
        self.sched_steps = int(extra["sched_steps"])
        rng = path / state_io.rank_rng_file(self.rank)
        if rng.is_file():
            state_io.load_rng(rng, self.device)
        else:  # saved by fewer ranks (another EP / DP size): this rank keeps its own RNG stream
            log.info("megatron load: %s has no RNG state for rank %d; keeping this rank's", path, self.rank)
        return int(extra["steps_done"])
