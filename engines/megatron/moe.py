"""Mixture-of-Experts in the Megatron backend: router options -> megatron-core config, the auxiliary losses'
gradient scale under our normalised losses, and the `moe/*` metrics of each train step.

Metrics (every optimizer step, on every rank): `moe/aux_loss` and `moe/z_loss` (megatron's tracker: the
unscaled loss per MoE layer and micro-batch, averaged over both; only when its coefficient is > 0) and
`moe/tokens_per_expert_imbalance` (routed tokens of the busiest expert over the mean, worst MoE layer, counted
over the data-parallel ranks; 1.0 = perfectly balanced). Non-goal: the token dispatch itself (megatron-core).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rlstages.configs.training import MegatronTrainingConfig

TRACKED = {"load_balancing_loss": "moe/aux_loss", "seq_load_balancing_loss": "moe/aux_loss", "z_loss": "moe/z_loss"}


def config_overrides(options: MegatronTrainingConfig, tp: int) -> dict[str, Any]:
    """TransformerConfig fields of an MoE model from the router options (dropless unless a capacity is set)."""
    moe = options.moe
    config: dict[str, Any] = {
        "expert_model_parallel_size": options.expert_model_parallel_size,
        "expert_tensor_parallel_size": options.expert_tensor_parallel_size or tp,
        "moe_token_dispatcher_type": moe.token_dispatcher,
        "moe_aux_loss_coeff": moe.aux_loss_coeff,
        "moe_router_load_balancing_type": moe.load_balancing_type,
        "moe_z_loss_coeff": moe.z_loss_coeff or None,
        "moe_expert_capacity_factor": moe.expert_capacity_factor,
        "moe_token_dropping": moe.expert_capacity_factor is not None,
    }
    if moe.router_topk is not None:
        config["moe_router_topk"] = moe.router_topk
    return config


@contextlib.contextmanager
def aux_loss_scale(factor: float) -> Iterator[None]:
    """Scale the routers' auxiliary-loss gradients by `factor` while megatron's schedule runs.

    With `calculate_per_token_loss` (our losses arrive normalised) megatron multiplies each micro-batch's aux
    and z-loss by its token count, expecting a later 1 / total-tokens that our backend never applies; the
    factor 1 / (this rank's tokens in the step) makes them the token-weighted mean over micro-batches.
    """
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    original = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]

    def scaled(scale: torch.Tensor) -> None:
        original.__func__(scale * factor)

    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(scaled)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = original  # type: ignore[method-assign]


class ExpertLoad:
    """Counts the tokens each router sends to each expert (forward hooks on megatron's `TopKRouter`s)."""

    def __init__(self, chunks: list[Any]) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        self.counts: list[torch.Tensor | None] = [None] * len(self.routers)
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    def _hook(self, index: int) -> Any:
        def count(module: Any, inputs: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            routed = output[1].sum(dim=0).detach().float()  # routing_map [tokens, experts] -> per expert
            current = self.counts[index]
            self.counts[index] = routed if current is None else current + routed

        return count

    def reset(self) -> None:
        """Forget the counts (at the start of each train step)."""
        self.counts = [None] * len(self.routers)

    def imbalance(self) -> float:
        """The max / mean routed tokens per expert of the worst MoE layer, over data-parallel ranks and stages."""
        from megatron.core import parallel_state as ps

        worst = torch.zeros(())
        for counts in self.counts:
            if counts is None:
                continue
            total = counts.clone()
            torch.distributed.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
            if total.sum() > 0:
                worst = torch.maximum(worst, total.max() / total.mean())
        if ps.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(
                worst, op=torch.distributed.ReduceOp.MAX, group=ps.get_pipeline_model_parallel_group()
            )
        return float(worst)


def tracked_losses(options: MegatronTrainingConfig) -> list[str]:
    """The names megatron's tracker records for these router options (a loss is tracked when its coefficient
    is > 0), the same on every rank."""
    moe, names = options.moe, []
    if moe.aux_loss_coeff > 0 and moe.load_balancing_type != "none":
        names.append("seq_load_balancing_loss" if moe.load_balancing_type == "seq_aux_loss" else "load_balancing_loss")
    if moe.z_loss_coeff:
        names.append("z_loss")
    return names


def step_metrics(load: ExpertLoad, names: list[str], num_microbatches: int, num_layers: int) -> dict[str, float]:
    """The `moe/*` metrics of the train step just run (a collective over the PP / DP groups: every rank calls
    it with the same `names`); clears megatron's tracker."""
    from megatron.core.transformer.moe import moe_utils

    metrics = {"moe/tokens_per_expert_imbalance": load.imbalance()}
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    for name in names:  # a stage that ran no MoE layer still joins the reductions
        tracker.setdefault(name, {"values": torch.zeros(num_layers), "reduce_group": None, "avg_group": None})
    if names:
        moe_utils.reduce_aux_losses_tracker_across_ranks(names)
        moe_layers = max(1, _layers_over_stages(len(load.routers)))
        for name in names:
            metrics[TRACKED[name]] = float(tracker[name]["values"].sum()) / (max(1, num_microbatches) * moe_layers)
        moe_utils.clear_aux_losses_tracker()
    return metrics


def _layers_over_stages(local: int) -> int:
    """MoE layers of the whole model: this stage's routers summed over the pipeline group."""
    from megatron.core import parallel_state as ps

    count = torch.tensor(float(local))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(count, group=ps.get_pipeline_model_parallel_group())
    return int(count)
