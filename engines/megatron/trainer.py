"""Megatron-Core training engine: actor, critic (value head) or frozen reference under TP / PP (+VPP) / DP.

Each Ray rank (RANK / WORLD_SIZE / MASTER_* from the actor group) joins one process group, builds its
GPTModel chunk(s) and loads its own shard of the converted checkpoint (critic and reference, which get no
`converted_path`, convert the HF directory in memory). Forward and backward run through megatron-core's
schedule (`get_forward_backward_func`; 1F1B when PP > 1); the response log-probs are read from the
TP-gathered logits at the same positions as `ppo_step.causal_lm_forward`, and the losses, epochs loop and
metrics are `ppo_step`'s. Gradients are reduced by megatron's DDP (mean over data-parallel ranks), the
update is megatron's optimizer (torch AdamW inside, or the distributed optimizer), clipped at
`optim.grad_clip` and skipped on a non-finite norm, with `torch_trainer.lr_lambda` as the schedule.

Offload mapping (megatron-core 0.16): `optimizer_offload` -> OptimizerConfig.optimizer_cpu_offload with
`optimizer_offload_fraction = offload_fraction` (HybridDeviceOptimizer); `grad_offload` -> DDP
offload/restore_grad_buffers around each train step; `param_offload` -> the DDP param buffers'
offload_to_cpu/reload_from_cpu around every call. Without CUDA all three are no-ops (everything already
lives in host memory; logged once). Collectives: `named_weights`, `weight_buckets`, `save_pretrained`,
`save` and `load` must be called on every rank of the model-parallel group at once.

Non-goals: context / expert parallelism, float16 and bf16_autocast (use dtype bfloat16); without CUDA also
activation recompute and sequence parallelism (megatron-core's torch-norm fallback rejects it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.megatron import cuda_shim
from rlstages.engines.megatron import optim as MO
from rlstages.engines.megatron import parallel as MP
from rlstages.engines.models import torch_dtype
from rlstages.engines.registry import has_module
from rlstages.engines.runtime.weight_sync import Bucket, bucketize
from rlstages.engines.training import ppo_step as P
from rlstages.engines.training import state_io
from rlstages.engines.training.microbatch import micro_batches
from rlstages.engines.training.torch_trainer import BatchingParams, OptimParams, Role, lr_lambda

log = logging.getLogger(__name__)
CKPT_DIR = "mcore"  # megatron-core dist checkpoint (model + optimizer), relative to the `save` directory


class MegatronTrainingEngine:
    """One rank of a Megatron-Core model and optimizer; implements `rlstages.engines.base.TrainingEngine`."""

    def __init__(
        self,
        model_path: str | Path,
        role: Role = "actor",
        optim: OptimParams = OptimParams(),
        batching: BatchingParams = BatchingParams(),
        loss: A.PolicyLossParams = A.PolicyLossParams(),
        cliprange_value: float = 0.5,
        temperature: float = 1.0,
        dtype: str = "float32",
        model_type: str | None = None,
        seed: int = 0,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int | None = None,
        context_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        sequence_parallel: bool = False,
        use_distributed_optimizer: bool = True,
        param_offload: bool = False,
        grad_offload: bool = False,
        optimizer_offload: bool = False,
        offload_fraction: float = 1.0,
        transformer_impl: str = "local",
        converted_path: str | Path | None = None,
    ) -> None:
        if dtype == "float16":
            raise NotImplementedError("megatron backend: dtype float16 needs loss scaling; use bfloat16 or float32")
        if batching.bf16_autocast:
            raise NotImplementedError(
                "megatron backend: bf16_autocast is not supported (megatron's linear layers have no autocast "
                "backward); use dtype: bfloat16 (bf16 weights, fp32 main params in megatron's optimizer)"
            )
        if batching.gradient_checkpointing and not torch.cuda.is_available():
            raise NotImplementedError("megatron activation recompute saves CUDA RNG state: it needs a GPU")
        if transformer_impl == "transformer_engine" and not has_module("transformer_engine"):
            raise ImportError("transformer_impl='transformer_engine' needs transformer_engine (GPU); use 'local'")
        torch.manual_seed(seed)
        self.role, self.optim, self.batching, self.loss = role, optim, batching, loss
        self.temperature, self.cliprange_value = temperature, cliprange_value
        self.layout = MP.Layout(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size or 1,
            context_parallel_size,
            expert_model_parallel_size,
            sequence_parallel,
        )
        MP.init_distributed(self.layout, seed)
        from megatron.core import parallel_state as ps

        self.spec = MP.resolve_spec(converted_path, model_path, self.layout, transformer_impl)
        if model_type is not None and model_type != self.spec.template.hf_model_type:
            raise ValueError(f"model_type={model_type!r} but the checkpoint is {self.spec.template.hf_model_type!r}")
        self.converted_path = Path(converted_path) if converted_path is not None else None
        self.rank, self.tp_rank = torch.distributed.get_rank(), ps.get_tensor_model_parallel_rank()
        self.dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        self.dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        self.dtype = torch_dtype(dtype)
        states = MP.rank_state(
            self.spec, converted_path, model_path, self.tp_rank, ps.get_pipeline_model_parallel_rank()
        )
        self.chunks = MP.build_chunks(self.spec, states, role, self.dtype, self._config_overrides(), seed)
        del states
        self.offload = {"param": param_offload, "grad": grad_offload, "optimizer": optimizer_offload}
        if any(self.offload.values()) and not torch.cuda.is_available():
            log.info(
                "megatron offload %s: no-ops without CUDA (weights/grads/states already in host memory)", self.offload
            )
        self.optimizer: Any = None
        if role == "reference":
            for chunk in self.chunks:
                chunk.requires_grad_(False).eval()
            self.models = list(self.chunks)
        else:
            self.models = self._wrap_ddp(use_distributed_optimizer)
            offload = (optimizer_offload, offload_fraction)
            self.optimizer = MO.build_optimizer(self.models, optim, self.dtype, use_distributed_optimizer, *offload)
        self.sched_steps = 0  # optimizer steps taken (the LR schedule's position)
        self.steps_done = 0

    def _config_overrides(self) -> dict[str, Any]:
        lay = self.layout
        config: dict[str, Any] = {
            "calculate_per_token_loss": True,  # our losses are already normalised: the schedule must not divide
            "sequence_parallel": lay.sequence_parallel,
            "context_parallel_size": lay.cp,
            "expert_model_parallel_size": lay.ep,
            "bf16": self.dtype == torch.bfloat16,
        }
        if lay.pp > 1:  # micro-batches are trimmed to their own length: pipeline sends carry their shapes
            config.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
            # gloo: with 2 stages next == prev, and batched p2p ops (one communicator, both directions at once
            # under VPP) pair an activation with a gradient of the same shape; unbatched ops use two groups.
            config.update(batch_p2p_comm=torch.cuda.is_available())
        if self.batching.gradient_checkpointing:
            config.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        return config

    def _wrap_ddp(self, distributed_optimizer: bool) -> list[Any]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
        )
        return [DistributedDataParallel(c.config, ddp, c, disable_bucketing=v > 0) for v, c in enumerate(self.chunks)]

    # ---- forward passes -------------------------------------------------------------------------------------
    def _micro(self, batch: TensorDict) -> list[TensorDict]:
        b = self.batching
        return micro_batches(batch, b.micro_batch_size, b.dynamic_batching, b.max_tokens_per_micro_batch)

    def _response(self, output: torch.Tensor, mb: TensorDict, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy [B, T] of the response tokens from full-vocab logits [B, S, V_padded]."""
        start, width = mb[T.PROMPT_IDS].shape[1] - 1, mb[T.RESPONSE_IDS].shape[1]
        logits = output[:, start : start + width, : self.spec.hf_vocab_size].float() / self.temperature
        logp = A.logprobs_from_logits(logits, mb[T.RESPONSE_IDS])
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            entropy = A.entropy_from_logits(logits)
        return logp, entropy

    @staticmethod
    def _values(output: torch.Tensor, mb: TensorDict) -> torch.Tensor:
        start, width = mb[T.PROMPT_IDS].shape[1] - 1, mb[T.RESPONSE_IDS].shape[1]
        return output[:, start : start + width, 0].float()

    def _forward_only(self, batch: TensorDict, read: Any) -> list[list[torch.Tensor]] | None:
        """Run the micro-batches forward; per micro-batch `read(output, mb)` on the last stage (else None)."""
        outs: list[list[torch.Tensor]] = []

        def collect(mb: TensorDict, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            width = batch[T.RESPONSE_IDS].shape[1]
            outs.append([P.pad_cols(x, width) for x in read(output, mb)])
            return output.new_zeros(()), torch.zeros((), dtype=torch.int)

        with torch.no_grad(), self._resident():
            MP.run_schedule(self.models, self._micro(batch), collect, True, self.layout.tp)
        return outs if MP.is_last_stage() else None

    def logprobs(self, batch: TensorDict, temperature: float | None = None) -> TensorDict | None:
        """Teacher-forced log-probs and entropy [B, T] on the last pipeline stage (None on earlier stages)."""
        if temperature is not None:
            self.temperature = temperature
        outs = self._forward_only(batch, lambda out, mb: self._response(out, mb, False))
        if outs is None:
            return None
        empty = torch.zeros(0, batch[T.RESPONSE_IDS].shape[1])
        cols = {k: torch.cat([o[i] for o in outs]) if outs else empty for i, k in enumerate(("logprobs", "entropy"))}
        return TensorDict(cols, batch_size=batch.batch_size)

    def values(self, batch: TensorDict) -> torch.Tensor | None:
        """Critic values [B, T] on the last pipeline stage (None on earlier stages)."""
        if self.role != "critic":
            raise RuntimeError(f"values() needs role='critic', this engine is the {self.role}")
        outs = self._forward_only(batch, lambda out, mb: [self._values(out, mb)])
        if outs is None:
            return None
        return torch.cat([o[0] for o in outs]) if outs else torch.zeros(0, batch[T.RESPONSE_IDS].shape[1])

    # ---- training -------------------------------------------------------------------------------------------
    def train_step(self, batch: TensorDict) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches; the same metrics on every rank of the pipeline."""
        if self.optimizer is None:
            raise RuntimeError("the reference engine is frozen: train_step is not available")
        with self._resident(train=True):
            out = P.epochs_loop(batch, self.batching.ppo_epochs, self.batching.num_mini_batches, self._mini_step)
        self.steps_done += 1
        out["lr"] = self.optim.lr * lr_lambda(self.optim)(self.sched_steps)
        return out

    def _mini_step(self, mini: TensorDict, check_sync: bool) -> dict[str, float]:
        """One optimizer step: every micro-batch's backward through the schedule, DDP reduce, clip, step."""
        from megatron.core.distributed import finalize_model_grads

        norm = P.global_counts(mini)
        for model in self.models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        acc: dict[str, float] = {}

        def loss_fn(mb: TensorDict, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if self.role == "critic":
                loss, metrics = P.critic_loss(
                    self._values(output, mb), mb, self.cliprange_value, self.loss.loss_agg_mode, norm
                )
            else:
                logp, entropy = self._response(output, mb, bool(self.loss.entropy_coeff))
                loss, metrics = P.actor_loss(logp, entropy, mb, self.loss, norm, check_sync)
            P.accumulate(acc, metrics, float(mb[T.RESPONSE_MASK].sum() / norm["global_tokens"]))
            return loss, mb[T.RESPONSE_MASK].sum().int()

        MP.run_schedule(self.models, self._micro(mini), loss_fn, False, self.layout.tp)
        with cuda_shim.cuda_as_cpu():
            finalize_model_grads(self.models)  # DP reduce, sequence-parallel norms, tied embeddings over PP
        if self.dp > 1:  # per-token loss mode sums over DP ranks; average them as the other backends do
            for model in self.models:
                model.scale_gradients(1.0 / self.dp)
        acc = MP.share_from_last_stage(acc)
        acc["grad_norm"] = MO.optimizer_step(self.optimizer, self.optim, self.sched_steps)
        self.sched_steps += 1
        return acc

    @contextlib.contextmanager
    def _resident(self, train: bool = False) -> Iterator[None]:
        """On a GPU, bring offloaded params (and grads for training) back for the call and offload them after."""
        gpu = torch.cuda.is_available() and self.role != "reference"
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
        with self._resident():
            yield from MP.export_hf(self.chunks, self.spec, self.role)

    def weight_buckets(self, bucket_bytes: int, dtype: str) -> Iterator[Bucket]:
        """Encoded buckets of all HF weights on the weight source; the other ranks of its model-parallel group
        must run this concurrently (they take part in the gathers and yield nothing, as other DP replicas do)."""
        stream = self.named_weights()
        if not self.is_weight_source:
            for _ in stream:
                pass
            return
        yield from bucketize(stream, bucket_bytes, dtype)

    def save_pretrained(self, path: Path, tokenizer_from: Path | None = None) -> None:
        """An HF directory (config, safetensors, tokenizer) written by the weight source; call on every rank."""
        source = self.is_weight_source
        weights = {name: tensor.detach().clone() for name, tensor in self.named_weights() if source}
        if not source:
            return
        path = Path(path)
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
        if tokenizer_from is not None:
            from rlstages.engines.models import load_tokenizer

            load_tokenizer(tokenizer_from).save_pretrained(str(path))

    def _sharded_state(self, loading: bool) -> dict[str, Any]:
        from rlstages.engines.megatron.dist_ckpt import sharded_state_dict

        state: dict[str, Any] = {"model": sharded_state_dict(self.chunks)}
        if self.optimizer is not None:
            if loading:
                MO.init_adam_state(self.optimizer)
            with cuda_shim.cuda_as_cpu():
                state["optimizer"] = self.optimizer.sharded_state_dict(
                    state["model"], is_loading=loading, metadata=MO.OPTIM_METADATA
                )
        return state

    def save(self, path: Path) -> None:
        """megatron-core dist checkpoint of model + optimizer under `path/mcore` (every rank writes its shards),
        the schedule position (rank 0) and each rank's RNG state. Call on every rank with a shared `path`."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        (path / CKPT_DIR).mkdir(parents=True, exist_ok=True)
        with self._resident():
            dist_checkpointing.save(self._sharded_state(loading=False), str(path / CKPT_DIR))
        if self.rank == 0:
            extra = {"steps_done": self.steps_done, "sched_steps": self.sched_steps, "optim": asdict(self.optim)}
            state_io.atomic_write_text(path / state_io.EXTRA_FILE, json.dumps(extra))
        state_io.save_rng(path / f"rng_rank{self.rank}.safetensors")
        torch.distributed.barrier()

    def load(self, path: Path) -> None:
        """Restore what `save` wrote (every rank, same TP/PP layout; the data-parallel size may differ)."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        with self._resident():
            state = dist_checkpointing.load(self._sharded_state(loading=True), str(path / CKPT_DIR))
            models = state["model"]
            for v, chunk in enumerate(self.chunks):
                chunk.load_state_dict(models if len(self.chunks) == 1 else models[f"model{v}"], strict=True)
            if self.optimizer is not None:
                with cuda_shim.cuda_as_cpu(), torch.no_grad():
                    self.optimizer.load_state_dict(state["optimizer"])
                MO.restore_adam_steps(self.optimizer)
        extra = json.loads((path / state_io.EXTRA_FILE).read_text())
        self.steps_done, self.sched_steps = int(extra["steps_done"]), int(extra["sched_steps"])
        state_io.load_rng(path / f"rng_rank{self.rank}.safetensors")
