"""Expert weight layouts of Mixture-of-Experts models: fused in memory (transformers >= 5) vs per expert on disk.

transformers >= 5 holds a layer's routed experts as 3-D parameters (`mlp.experts.gate_up_proj` [E, 2F, H],
`mlp.experts.down_proj` [E, H, F]) and converts from and to the checkpoint layout, one tensor per expert
(`mlp.experts.E.{gate,up,down}_proj.weight`; Mixtral `block_sparse_moe.experts.E.w1/w3/w2`), when it loads
and saves. vLLM, SGLang and the Megatron export take the per-expert layout, the HF rollout engine's model holds
the fused one. `disk_named_weights` turns a model's in-memory tensors into the on-disk names and layout with
transformers' own `revert_weight_conversion` (exactly what `save_pretrained` writes); `ExpertSlots` maps an
on-disk expert tensor back to its slice of the fused parameter, for copying weights into an HF model.
Dense models (no fused experts) pass through unchanged. Non-goal: conversion to Megatron (`engines.convert`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

FUSED_SUFFIXES = (".experts.gate_up_proj", ".experts.down_proj")


def fused_expert_names(model: Any) -> list[str]:
    """Names of the model's fused (3-D) expert parameters; empty for dense models and per-expert MoE modules."""
    return [n for n, p in model.state_dict().items() if n.endswith(FUSED_SUFFIXES) and p.dim() == 3]


def disk_named_weights(model: Any, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` (the model's in-memory names) in the checkpoint's on-disk names and layout, one tensor at a time.

    Only models with fused experts are converted (each tensor through transformers' `revert_weight_conversion`,
    so renamings such as Mixtral's `mlp` -> `block_sparse_moe` apply too); others pass through as they are.
    """
    if not fused_expert_names(model):
        yield from named
        return
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in named:
        yield from revert_weight_conversion(model, {name: tensor}).items()


class ExpertSlots:
    """Where each on-disk tensor of a fused-experts model lives in memory: (parameter name, index).

    Built by probing transformers' reverse conversion with small index-coded tensors (expert count kept, other
    dims shrunk), so it follows whatever split and renaming the installed transformers applies.
    """

    def __init__(self, model: Any) -> None:
        self.slots: dict[str, tuple[str, tuple[Any, ...]]] = {}
        self.renames: dict[str, str] = {}
        fused = fused_expert_names(model)
        if not fused:
            return
        from transformers.core_model_loading import revert_weight_conversion

        state = model.state_dict()
        for name in fused:
            experts, rows, _ = state[name].shape
            parts = 2 if name.endswith(".gate_up_proj") else 1
            probe = torch.arange(experts * parts, dtype=torch.float64).reshape(experts, parts, 1)
            for disk, coded in revert_weight_conversion(model, {name: probe}).items():
                code = int(coded.reshape(-1)[0])
                expert, part = divmod(code, parts)
                size = rows // parts
                self.slots[disk] = (name, (expert, slice(part * size, (part + 1) * size)))
        for name in state:
            if name not in fused:
                (disk,) = revert_weight_conversion(model, {name: state[name]}).keys()
                if disk != name:
                    self.renames[disk] = name

    def target(self, disk_name: str) -> tuple[str, tuple[Any, ...]] | None:
        """(in-memory parameter name, index into it) of an on-disk tensor name; None when it is not remapped."""
        if disk_name in self.slots:
            return self.slots[disk_name]
        if disk_name in self.renames:
            return self.renames[disk_name], ()
        return None
