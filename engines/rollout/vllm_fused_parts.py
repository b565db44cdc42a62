"""A vLLM weight update's stream held back per fused layer (vLLM's `packed_modules_mapping`: q/k/v -> qkv_proj,
gate/up -> gate_up_proj) until every part of the layer has arrived."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rlstages.engines.base import NamedTensors


class FusedParts:
    """Holds back the parts of a fused vLLM layer (`packed_modules_mapping`) until all have arrived.

    Layerwise reload re-allocates a layer once it is touched, so a layer fed only some of its parts would
    keep garbage in the others. HF checkpoints list those parts next to each other, so little is held.
    """

    def __init__(self, packed_modules: dict[str, list[str]]) -> None:
        self.part_of = {p: (f, parts) for f, parts in packed_modules.items() if len(parts) > 1 for p in parts}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.expected: dict[str, list[str]] = {}

    def complete(self, stream: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass tensors through, releasing a fused layer's parts only once the layer is complete."""
        for name, tensor in stream:
            comps = name.split(".")
            hit = next((i for i, c in enumerate(comps) if c in self.part_of), None)
            if hit is None:
                yield name, tensor
                continue
            fused, parts = self.part_of[comps[hit]]
            key = ".".join([*comps[:hit], fused, *comps[hit + 1 :]])
            self.expected[key] = [".".join([*comps[:hit], p, *comps[hit + 1 :]]) for p in parts]
            group = self.pending.setdefault(key, {})
            group[name] = tensor
            if all(n in group for n in self.expected[key]):
                del self.pending[key]
                yield from ((n, group[n]) for n in self.expected[key])

    def incomplete(self) -> dict[str, list[str]]:
        """Fused layer -> the part names still missing."""
        return {k: [n for n in self.expected[k] if n not in g] for k, g in self.pending.items()}
