"""DeepSpeed training engine: actor, critic or frozen reference under ZeRO 1/2/3, optional CPU offload.

Each Ray rank holds one DeepSpeed engine; gradients are averaged over the data-parallel ranks. The DeepSpeed
JSON config is built from our typed options (`deepspeed_config`), never read from a file. The optimizer is
our own: torch AdamW, or DeepSpeedCPUAdam when the optimizer is offloaded; the LR schedule is
`torch_trainer.lr_lambda` as a client scheduler that DeepSpeed steps once per optimizer step. The forward
passes, losses and the epochs loop are `ppo_step`'s, so the update equals the torch backend's.

Gradient accumulation is driven per mini-batch (`set_gradient_accumulation_boundary` on the last
micro-batch, one `engine.step()`), so the micro-batch count may vary (dynamic batching); the losses are
already normalised by the mini-batch's counts, so `backward` does not divide by the accumulation steps.

Non-goals: pipeline/tensor parallelism (Megatron backend); DeepSpeed's own bf16 weights for
`bf16_autocast` (that stays torch.autocast, as in the torch backend; `dtype: bfloat16` selects DeepSpeed bf16).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from rlstages.engines import algorithms as A
from rlstages.engines import types as T
from rlstages.engines.runtime.weight_sync import Bucket, bucketize
from rlstages.engines.training import ppo_step as P
from rlstages.engines.training import state_io
from rlstages.engines.training.microbatch import micro_batches
from rlstages.engines.training.torch_trainer import BatchingParams, OptimParams, Role, build_model, lr_lambda

CKPT_DIR = "deepspeed"  # DeepSpeed's own checkpoint, relative to the `save` directory
CKPT_TAG = "state"


def init_distributed() -> None:
    """Join (or create) the process group from RANK/WORLD_SIZE/MASTER_* (defaults: one in-process rank)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": os.environ.get("RANK", "0"), "MASTER_ADDR": "127.0.0.1"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    import deepspeed

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def deepspeed_config(
    optim: OptimParams,
    batching: BatchingParams,
    zero_stage: int,
    offload_optimizer: bool,
    offload_param: bool,
    dtype: str,
    world_size: int,
) -> dict[str, Any]:
    """The DeepSpeed JSON config for our options (ZeRO stage, offload, clipping, mixed precision)."""
    zero: dict[str, Any] = {"stage": zero_stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": batching.micro_batch_size,
        # Nominal: the boundary is set by hand on each mini-batch's last micro-batch (their count varies).
        "gradient_accumulation_steps": 1,
        "train_batch_size": batching.micro_batch_size * world_size,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


@contextlib.contextmanager
def _zero3_construction(config: dict[str, Any]) -> Iterator[None]:
    """While alive, transformers builds models under `deepspeed.zero.Init` and loads weights into the shards."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(config)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()  # later models in this process (other engines) load unpartitioned
        del keep


class DeepSpeedTrainingEngine:
    """A DeepSpeed engine (model + ZeRO optimizer) on one rank; implements `rlstages.engines.base.TrainingEngine`."""

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
        zero_stage: int = 2,
        offload_optimizer: bool = False,
        offload_param: bool = False,
    ) -> None:
        if offload_param and zero_stage != 3:
            raise ValueError("offload_param needs zero_stage 3 (only ZeRO-3 partitions parameters)")
        init_distributed()
        import deepspeed

        torch.manual_seed(seed)
        if role == "reference" and zero_stage != 3:
            zero_stage, offload_optimizer = 0, False  # ZeRO 1/2 shard optimizer states; a frozen model has none
        self.role, self.optim, self.batching, self.loss = role, optim, batching, loss
        self.temperature, self.cliprange_value, self.zero_stage = temperature, cliprange_value, zero_stage
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.config = deepspeed_config(optim, batching, zero_stage, offload_optimizer, offload_param, dtype, self.world)
        with _zero3_construction(self.config) if zero_stage == 3 else contextlib.nullcontext():
            model = build_model(model_path, role, dtype, model_type)
        if batching.gradient_checkpointing and role != "reference":
            model.gradient_checkpointing_enable()
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if role == "reference":
            model.requires_grad_(False).eval()
        else:
            model.train()
            self.optimizer = _optimizer(model, optim, offload_optimizer)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim))
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=self.optimizer, lr_scheduler=self.scheduler, config=self.config
        )
        self.steps_done = 0

    @property
    def module(self) -> Any:
        """The wrapped HF model (its parameters are shards under ZeRO-3)."""
        return self.engine.module

    # ---- forward passes -------------------------------------------------------------------------------------
    def _micro(self, batch: TensorDict, size: int) -> tuple[list[TensorDict], int]:
        """Micro-batches and how many are real. ZeRO-3 all-gathers in every forward and ZeRO-2 reduces in every
        backward, so with several ranks the shorter ones repeat their last micro-batch (zero-weighted).
        """
        b = self.batching
        mbs = micro_batches(batch, size, b.dynamic_batching, b.max_tokens_per_micro_batch)
        real = len(mbs)
        if self.world > 1:
            count = torch.tensor([real], device=next(self.engine.parameters()).device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
            if real == 0 and int(count) > 0:
                raise ValueError(f"rank {self.rank} got no rows while other ranks did; give every rank rows")
            mbs += [mbs[-1]] * (int(count) - real)
        return mbs, real

    @torch.no_grad()
    def logprobs(self, batch: TensorDict, temperature: float | None = None) -> TensorDict:
        """Teacher-forced log-probs and entropy of the response tokens, [B, T] each (padded to the batch)."""
        if temperature is not None:
            self.temperature = temperature
        width = batch[T.RESPONSE_IDS].shape[1]
        logps, ents = [], []
        mbs, real = self._micro(batch, self.batching.micro_batch_size)
        for i, mb in enumerate(mbs):
            lp, ent = P.causal_lm_forward(self.engine, mb, self.temperature, self.batching.bf16_autocast)
            if i < real:
                logps.append(P.pad_cols(lp, width))
                ents.append(P.pad_cols(ent, width))
        empty = torch.zeros(0, width)
        out = {"logprobs": torch.cat(logps) if logps else empty, "entropy": torch.cat(ents) if ents else empty}
        return TensorDict(out, batch_size=batch.batch_size)

    @torch.no_grad()
    def values(self, batch: TensorDict) -> torch.Tensor:
        """Critic values of the response tokens, [B, T]."""
        width = batch[T.RESPONSE_IDS].shape[1]
        mbs, real = self._micro(batch, self.batching.micro_batch_size)
        out = [P.pad_cols(P.value_forward(self.engine, mb, self.batching.bf16_autocast), width) for mb in mbs]
        return torch.cat(out[:real]) if real else torch.zeros(0, width)

    # ---- training -------------------------------------------------------------------------------------------
    def train_step(self, batch: TensorDict) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches; returns averaged metrics (actor or critic names)."""
        if self.scheduler is None:
            raise RuntimeError("the reference engine is frozen: train_step is not available")
        out = P.epochs_loop(batch, self.batching.ppo_epochs, self.batching.num_mini_batches, self._mini_step)
        self.steps_done += 1
        out["lr"] = self.scheduler.get_last_lr()[0]
        return out

    def _mini_step(self, mini: TensorDict, check_sync: bool) -> dict[str, float]:
        """One optimizer step: accumulate every micro-batch's gradient, then `engine.step()` once."""
        norm = P.global_counts(mini)
        acc: dict[str, float] = {}
        mbs, real = self._micro(mini, self.batching.micro_batch_size)
        for i, mb in enumerate(mbs):
            if self.role == "critic":
                loss, metrics = P.critic_loss(
                    P.value_forward(self.engine, mb, self.batching.bf16_autocast),
                    mb,
                    self.cliprange_value,
                    self.loss.loss_agg_mode,
                    norm,
                )
            else:
                logp, entropy = P.causal_lm_forward(
                    self.engine, mb, self.temperature, self.batching.bf16_autocast, bool(self.loss.entropy_coeff)
                )
                loss, metrics = P.actor_loss(logp, entropy, mb, self.loss, norm, check_sync)
            self.engine.set_gradient_accumulation_boundary(i == len(mbs) - 1)
            # Our loss is already a share of the mini-batch's loss: no division by the accumulation steps.
            self.engine.backward(loss if i < real else loss * 0.0, scale_wrt_gas=False)
            if i < real:
                P.accumulate(acc, metrics, float(mb[T.RESPONSE_MASK].sum() / norm["global_tokens"]))
        grad_norm = None if self.zero_stage else _grad_norm(self.module)  # stage 0 does not record it
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm() if grad_norm is None else grad_norm
        acc["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        return acc

    # ---- weights and state ----------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, one at a time. Under ZeRO-3 each is gathered from the shards (a collective:
        every rank must iterate in step) and yielded as a copy on every rank.
        """
        import deepspeed

        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if hasattr(tensor, "ds_id"):
                with deepspeed.zero.GatheredParameters([tensor]):
                    yield name, tensor.detach().clone()
            else:
                yield name, tensor.detach()

    def weight_buckets(self, bucket_bytes: int, dtype: str) -> Iterator[Bucket]:
        """`named_weights` in encoded buckets for streaming to rollout engines (a generator for Ray)."""
        yield from bucketize(self.named_weights(), bucket_bytes, dtype)

    def _full_state(self) -> dict[str, torch.Tensor]:
        """Gathered weights on rank 0 (the other ranks join the gathers and get an empty dict)."""
        return {k: v for k, v in self.named_weights() if self.rank == 0}

    def save_pretrained(self, path: Path, tokenizer_from: Path | None = None) -> None:
        """An HF directory (config, safetensors, tokenizer) of the gathered weights, written by rank 0.
        Under ZeRO-3 with several ranks, call it on every rank (the gather is collective).
        """
        state = self._full_state()
        if self.rank != 0:
            return
        self.module.save_pretrained(str(path), state_dict=state, safe_serialization=True)
        if tokenizer_from is not None:
            from rlstages.engines.models import load_tokenizer

            load_tokenizer(tokenizer_from).save_pretrained(str(path))

    def save(self, path: Path) -> None:
        """DeepSpeed's checkpoint (model, ZeRO optimizer shards, scheduler; torch `.pt` files, DeepSpeed's format)
        under `path/deepspeed`, the full weights as `model.safetensors` (export) and each rank's RNG state.
        Every rank calls it; nothing records `path` itself, so the directory may be renamed.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.optimizer is not None:  # a frozen reference has no DeepSpeed checkpoint: its weights suffice
            client_state = {"steps_done": self.steps_done}
            self.engine.save_checkpoint(str(path / CKPT_DIR), tag=CKPT_TAG, client_state=client_state)
        state = self._full_state()
        if self.rank == 0:
            state_io.save_tensors(state, path / state_io.MODEL_FILE)
        state_io.save_rng(path / _rng_file(self.rank))
        torch.distributed.barrier()

    def load(self, path: Path) -> None:
        """Restore what `save` wrote (every rank calls it, with the world size that saved it)."""
        path = Path(path)
        if self.optimizer is None:
            self._load_weights(path / state_io.MODEL_FILE)
        else:
            _, client_state = self.engine.load_checkpoint(str(path / CKPT_DIR), tag=CKPT_TAG)
            if client_state is None:
                raise FileNotFoundError(f"{path / CKPT_DIR}: no DeepSpeed checkpoint with tag {CKPT_TAG!r}")
            self.steps_done = int(client_state.get("steps_done", 0))
        state_io.load_rng(path / _rng_file(self.rank))

    def _load_weights(self, file: Path) -> None:
        """Copy full HF-named weights into the model (into each ZeRO-3 shard through a gather from rank 0)."""
        import deepspeed
        from safetensors.torch import load_file

        weights = load_file(str(file))
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if name not in weights:
                raise ValueError(f"{file}: checkpoint does not match the model (missing {name})")
            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0, enabled=hasattr(tensor, "ds_id")):
                if self.rank == 0 or not hasattr(tensor, "ds_id"):
                    tensor.data.copy_(weights[name])


def _optimizer(model: Any, optim: OptimParams, offload: bool) -> torch.optim.Optimizer:
    """Torch AdamW (identical to the torch backend), or DeepSpeed's CPU AdamW (a one-off JIT build) when the
    optimizer states live on the CPU, which DeepSpeed requires for offload."""
    kwargs = {"lr": optim.lr, "betas": optim.betas, "eps": optim.eps, "weight_decay": optim.weight_decay}
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(model.parameters(), adamw_mode=True, **kwargs)
    return torch.optim.AdamW(model.parameters(), **kwargs)


def _grad_norm(model: Any) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"
