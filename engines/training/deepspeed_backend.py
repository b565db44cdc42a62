"""DeepSpeed step backend: actor, critic or frozen reference under ZeRO 1/2/3, optional CPU offload.

Each Ray rank holds one DeepSpeed engine; gradients are averaged over the data-parallel ranks. The DeepSpeed
JSON config is built from our typed options (`deepspeed_config`), never read from a file. The optimizer is
our own: torch AdamW, or DeepSpeedCPUAdam when the optimizer is offloaded; the LR schedule is
`training.optim.lr_lambda` as a client scheduler that DeepSpeed steps once per optimizer step. Forward passes
are the torch backend's (`hf_forward`) and the loop is `PPOTrainer`'s, so the update equals the torch backend's.

Gradient accumulation is driven per mini-batch (`set_gradient_accumulation_boundary` on the last
micro-batch, one `engine.step()`), so the micro-batch count may vary (dynamic batching); the losses are
already normalised by the mini-batch's counts, so `backward` does not divide by the accumulation steps.
ZeRO-3 all-gathers in every forward and ZeRO-2 reduces in every backward, so with several ranks the ranks
with fewer micro-batches repeat their last one with a zero loss (`_pad`).

Image batches of a vision-language model train as in the torch backend (the same forward: pixel values per
micro-batch, M-RoPE positions); a micro-batch without images runs a zero-weighted dummy pass through the vision
tower (`models.vision.dummy_vision_pass`), so under ZeRO-3 every rank gathers and reduces the vision tower's
parameters in the same order whatever its rows (docs/vlm.md).

Non-goals: pipeline/tensor parallelism (Megatron backend); DeepSpeed's own bf16 weights for
`bf16_autocast` (that stays torch.autocast, as in the torch backend; `dtype: bfloat16` selects DeepSpeed bf16).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rlstages.configs.training import DeepSpeedTrainingConfig
from rlstages.engines.base import OnOutput, Readout
from rlstages.engines.models import moe_layout
from rlstages.engines.runtime.device import dist_backend
from rlstages.engines.tensordict_import import TensorDict
from rlstages.engines.training import state_io
from rlstages.engines.training.optim import adamw, adamw_kwargs, lr_scheduler
from rlstages.engines.training.settings import TrainerSettings
from rlstages.engines.training.torch_backend import (
    build_model,
    fuse_on_device,
    hf_forward,
    optimizer_params,
    prepare_model,
)
from rlstages.engines.utils import free_port

CKPT_DIR = "deepspeed"  # DeepSpeed's own checkpoint, relative to the `save` directory
CKPT_TAG = "state"


def init_distributed(device: torch.device) -> torch.device:
    """Join (or create) the process group from RANK/WORLD_SIZE/MASTER_* (defaults: one in-process rank); returns
    `device` (the worker's). On a GPU, LOCAL_RANK becomes the index of the worker's GPU among the visible ones (Ray
    narrows them to one: 0), since DeepSpeed takes its device from LOCAL_RANK; NCCL then runs on that GPU."""
    if device.type != "cuda":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": os.environ.get("RANK", "0"), "MASTER_ADDR": "127.0.0.1"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if device.type == "cuda":
        os.environ["LOCAL_RANK"] = str(device.index)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    import deepspeed

    _forget_destroyed_groups()
    if not torch.distributed.is_initialized():  # plain nccl on GPUs: every DeepSpeed collective is on the device
        if device.type != "cuda":
            _skip_shm_all_reduce_build()
        deepspeed.init_distributed(dist_backend=dist_backend(device, cpu_collectives=False))
    return device


def _skip_shm_all_reduce_build() -> None:
    """Keep DeepSpeed's CPU backend from JIT-building its shared-memory all-reduce op (`deepspeed_shm_comm`, ~80 s
    of C++ on two cores per fresh venv, again whenever its torch-extensions cache was built by another venv) when
    the process group starts: only DeepSpeed's inference all-reduce uses it; ZeRO's collectives are
    torch.distributed's."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)  # probed on first read; build_shm_op asks it
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


def _forget_destroyed_groups() -> None:
    """Drop DeepSpeed's cached clones of process groups when they belong to a world destroyed earlier in this
    process (through torch, not `deepspeed.comm`): DeepSpeed would hand the dead clone to the new engine ("Group ...
    is not registered"), whether or not another world has started since."""
    from deepspeed.utils import groups

    cached = getattr(groups, "_WORLD_GROUP", None)
    if cached is None:
        return
    try:
        torch.distributed.get_process_group_ranks(cached)  # raises for a group of no live world
        return
    except (ValueError, RuntimeError, KeyError):
        pass
    release = getattr(groups, "_release_process_group_references", None)  # DeepSpeed >= 0.17; WORLD teardown
    if release is not None:
        release()


def deepspeed_config(
    settings: TrainerSettings, options: DeepSpeedTrainingConfig, world_size: int, on_gpu: bool = False
) -> dict[str, Any]:
    """The DeepSpeed JSON config for our options (ZeRO stage, offload, clipping, mixed precision); offloaded
    states in pinned host memory when the rank is `on_gpu` (faster copies to and from the GPU)."""
    zero: dict[str, Any] = {"stage": options.zero_stage}
    if options.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if options.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    micro = settings.train.micro_batch_size
    return {
        "train_micro_batch_size_per_gpu": micro,
        # Nominal: the boundary is set by hand on each mini-batch's last micro-batch (their count varies).
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro * world_size,
        "gradient_clipping": settings.optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": settings.dtype == "bfloat16"},
        "fp16": {"enabled": settings.dtype == "float16"},
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


class DeepSpeedBackend:
    """A DeepSpeed engine (model + ZeRO optimizer) on one rank; implements `rlstages.engines.base.StepBackend`."""

    outputs_here = True
    is_weight_source = True  # every data-parallel rank yields the full weights (ZeRO-3 gathers them)
    keeps_weights = False  # ZeRO-3's gathered parameters are released after each one

    def __init__(self, settings: TrainerSettings) -> None:
        options = settings.train
        if not isinstance(options, DeepSpeedTrainingConfig):  # a reference gets the defaults
            options = DeepSpeedTrainingConfig()
        self.device = init_distributed(settings.resolved_device())
        import deepspeed

        if not settings.trainable and options.zero_stage != 3:
            # ZeRO 1/2 shard optimizer states; a frozen model has none
            options = options.model_copy(update={"zero_stage": 0, "offload_optimizer": False})
        self.settings, self.zero_stage = settings, options.zero_stage
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.config = deepspeed_config(settings, options, self.world, self.device.type == "cuda")
        with _zero3_construction(self.config) if self.zero_stage == 3 else contextlib.nullcontext():
            model = build_model(settings.model_path, settings.role, settings.dtype, settings.model_type)
        prepare_model(model, settings)
        if settings.trainable and options.fuse_elementwise:
            fuse_on_device(model, self.device)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if settings.trainable:
            self.optimizer = _optimizer(model, settings, options.offload_optimizer)
            self.scheduler = lr_scheduler(self.optimizer, settings.optim, settings.optim_steps)
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=self.optimizer, lr_scheduler=self.scheduler, config=self.config
        )

    @property
    def module(self) -> Any:
        """The wrapped HF model (its parameters are shards under ZeRO-3)."""
        return self.engine.module

    def _pad(self, mbs: list[TensorDict]) -> list[TensorDict]:
        """With several ranks, repeat the last micro-batch up to the largest count of any rank."""
        if self.world == 1:
            return mbs
        count = torch.tensor([len(mbs)], device=next(self.engine.parameters()).device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        if not mbs and int(count) > 0:
            raise ValueError(f"rank {self.rank} got no rows while other ranks did; give every rank rows")
        return mbs + [mbs[-1]] * (int(count) - len(mbs))

    def run(self, mbs: list[TensorDict], readout: Readout, on_output: OnOutput, train: bool) -> None:
        """Forward (and backward) each micro-batch; padding micro-batches get no callback and a zero loss."""
        real, padded = len(mbs), self._pad(mbs)
        for i, mb in enumerate(padded):
            out = hf_forward(self.engine, mb, readout, self.settings.train)
            loss = on_output(mb, out) if i < real else out[0].sum() * 0.0
            if train:
                assert loss is not None
                self.engine.set_gradient_accumulation_boundary(i == len(padded) - 1)
                # Our loss is already a share of the mini-batch's loss: no division by the accumulation steps.
                self.engine.backward(loss, scale_wrt_gas=False)

    def resident(self, train: bool) -> contextlib.AbstractContextManager[None]:
        """DeepSpeed moves offloaded states itself."""
        return contextlib.nullcontext()

    def share(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each rank reports the metrics of its own rows."""
        return metrics

    def optimizer_step(self) -> float:
        """`engine.step()`: DeepSpeed clips, steps (or skips an overflow) and steps the client scheduler."""
        grad_norm = None if self.zero_stage else _grad_norm(self.module)  # stage 0 does not record it
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm() if grad_norm is None else grad_norm
        return float(grad_norm) if grad_norm is not None else float("nan")

    def lr(self) -> float:
        """The client scheduler's current LR."""
        assert self.scheduler is not None
        return float(self.scheduler.get_last_lr()[0])

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, one at a time. Under ZeRO-3 each is gathered from the shards (a collective:
        every rank must iterate in step) and yielded as a copy on every rank. MoE experts come in the on-disk
        layout, one tensor per expert (`models.moe_layout`), as vLLM loads them.
        """
        yield from moe_layout.disk_named_weights(self.module, self._gathered_weights())

    def _gathered_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        import deepspeed

        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if hasattr(tensor, "ds_id"):
                with deepspeed.zero.GatheredParameters([tensor]):
                    yield name, tensor.detach().clone()
            else:
                yield name, tensor.detach()

    def _full_state(self) -> dict[str, torch.Tensor]:
        """Gathered weights on rank 0 (the other ranks join the gathers and get an empty dict)."""
        return {k: v for k, v in self.named_weights() if self.rank == 0}

    def save_hf(self, path: Path) -> bool:
        """The gathered weights as an HF directory, written by rank 0 (under ZeRO-3 every rank must call)."""
        state = self._full_state()
        if self.rank == 0:
            self.module.save_pretrained(str(path), state_dict=state, safe_serialization=True)
        return self.rank == 0

    def save(self, path: Path, steps_done: int) -> None:
        """DeepSpeed's checkpoint (model, ZeRO optimizer shards, scheduler; torch `.pt` files, DeepSpeed's format)
        under `path/deepspeed`, the full weights as `model.safetensors` (export) and each rank's RNG state.
        Every rank calls it; nothing records `path` itself, so the directory may be renamed.
        """
        if self.optimizer is not None:  # a frozen reference has no DeepSpeed checkpoint: its weights suffice
            client_state = {"steps_done": steps_done}
            self.engine.save_checkpoint(str(path / CKPT_DIR), tag=CKPT_TAG, client_state=client_state)
        state = self._full_state()
        if self.rank == 0:
            state_io.save_tensors(state, path / state_io.MODEL_FILE)
        state_io.save_rng(path / state_io.rank_rng_file(self.rank))
        torch.distributed.barrier()

    def load(self, path: Path) -> int | None:
        """Restore what `save` wrote (every rank calls it, with the world size that saved it)."""
        steps = None
        if self.optimizer is None:
            self._load_weights(path / state_io.MODEL_FILE)
        else:
            _, client_state = self.engine.load_checkpoint(str(path / CKPT_DIR), tag=CKPT_TAG)
            if client_state is None:
                raise FileNotFoundError(f"{path / CKPT_DIR}: no DeepSpeed checkpoint with tag {CKPT_TAG!r}")
            steps = int(client_state.get("steps_done", 0))
        state_io.load_rng(path / state_io.rank_rng_file(self.rank), self.device)
        return steps

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


def _optimizer(model: Any, settings: TrainerSettings, offload: bool) -> torch.optim.Optimizer:
    """Torch AdamW (identical to the torch backend; fused, on CUDA too, so DeepSpeed's FusedAdam and its JIT
    build are not needed), or DeepSpeed's CPU AdamW (a one-off JIT build) when the optimizer states live on
    the CPU, which DeepSpeed requires for offload. A vision-language model's parts as the torch backend groups
    them (`actor.freeze`, `optim.group_lr`)."""
    params = optimizer_params(model, model.parameters(), settings)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **adamw_kwargs(settings.optim))
    return adamw(params, settings.optim)


def _grad_norm(model: Any) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
