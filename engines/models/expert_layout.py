"""Two HF layouts of Mixture-of-Experts weights: the on-disk one (one tensor per expert,
`mlp.experts.<E>.{gate,up,down}_proj.weight`, what Megatron's export and vLLM's loader use) and transformers 5's
in-memory one (`mlp.experts.gate_up_proj` [E, 2 x I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]).

`expert_view` finds the slice of an in-memory fused parameter that an on-disk name denotes (so a rollout engine
holding the fused model can take per-expert weight syncs); `per_expert` splits fused tensors into on-disk names.
Qwen3-MoE's naming (gate/up/down); other per-expert names are left to their template. Non-goal: conversion.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import torch

_ON_DISK = re.compile(r"^(?P<head>.*\.experts\.)(?P<index>\d+)\.(?P<part>gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^(?P<head>.*\.experts\.)(?P<param>gate_up_proj|down_proj)$")


def expert_view(params: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The view of a fused in-memory parameter that the on-disk per-expert `name` denotes; None when `name`
    is not a per-expert name or the model does not hold that fused parameter."""
    m = _ON_DISK.match(name)
    if m is None:
        return None
    fused = params.get(m["head"] + ("down_proj" if m["part"] == "down" else "gate_up_proj"))
    if fused is None:
        return None
    expert = fused[int(m["index"])]
    if m["part"] == "down":
        return expert
    half = expert.shape[0] // 2
    return expert[:half] if m["part"] == "gate" else expert[half:]


def per_expert(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Fused expert tensors as one tensor per expert with on-disk names; every other tensor unchanged."""
    for name, tensor in named:
        m = _FUSED.match(name)
        if m is None or tensor.dim() != 3:
            yield name, tensor
            continue
        for index, expert in enumerate(tensor):
            if m["param"] == "down_proj":
                yield f"{m['head']}{index}.down_proj.weight", expert
                continue
            gate, up = expert.chunk(2, dim=0)
            yield f"{m['head']}{index}.gate_proj.weight", gate
            yield f"{m['head']}{index}.up_proj.weight", up
