"""The rollout's copies of a Llama-family model's weights for the fast decode step (`fast_step`): per layer the
fused q/k/v and gate/up matrices, in the step's compute dtype, packed for oneDNN where `packed_gemm` allows; an fp32
copy of a bf16 model where the CPU has no native bf16 (4 bytes a parameter, held while generating), which the
transformers model prefills on by swapping them in for its own parameters.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from rlstages.engines.rollout.packed_gemm import linear, pack, packing_off

log = logging.getLogger(__name__)


class RolloutWeights:
    """The weights the fast step multiplies, in `dtype`: per layer the fused qkv and gate/up matrices; views of
    them stand in for the transformers model's parameters while it prefills (`swapped`). With `pack` (a CPU
    model whose parameters are all of `dtype`): the four matrices of each layer and the head in oneDNN's blocked
    layout where `packed_gemm.packing_off` allows, the rest the model's own tensors, and no views (the model
    prefills on its own parameters). With `pack` and an fp32 copy of a bf16 model (`widened`): the matrices and
    the head are packed fp32 and not kept plain (the plain copy's memory), the decode looks up the model's own
    embedding rows, and the prefill widens one module's matrices at a time while it runs."""

    def __init__(self, model: Any, dtype: torch.dtype, pack: bool = False) -> None:
        self.dtype = dtype
        self.views: dict[str, torch.Tensor] = {}
        self.layers: list[dict[str, Any]] = []
        params = list(model.parameters())
        self.plain_reason: str | None = None  # why a matrix stayed plain where packing was asked for
        cpu = params[0].device.type == "cpu"
        self.pack = pack and cpu and all(p.dtype == dtype for p in params)
        self.widened = pack and cpu and dtype == torch.float32 and all(p.dtype == torch.bfloat16 for p in params)
        if self.widened:
            self.plain_reason = packing_off(dtype, params[0].device, widened=True)
            self.widened = self.plain_reason is None
        self.packed = 0  # matrices in oneDNN's layout
        inner = model.model
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            prefix = f"model.layers.{i}."
            qkv = self._fuse(prefix + "self_attn.", attn, ("q_proj", "k_proj", "v_proj"))
            gate_up = self._fuse(prefix + "mlp.", mlp, ("gate_proj", "up_proj"))
            self.layers.append(
                {
                    "ln1": self._own(prefix + "input_layernorm.weight", layer.input_layernorm.weight),
                    "ln2": self._own(prefix + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight),
                    "qkv": qkv,
                    "o": self._linear(prefix + "self_attn.o_proj", attn.o_proj),
                    "gate_up": gate_up,
                    "down": self._linear(prefix + "mlp.down_proj", mlp.down_proj),
                }
            )
        self.norm = self._own("model.norm.weight", inner.norm.weight)
        head = model.lm_head.weight
        if self.widened:  # the model's own rows looked up and widened (exact), the head only packed
            self.embed = inner.embed_tokens.weight.detach()
            self.head = self._packed(head.detach().to(dtype))
        else:
            self.embed = self._own("model.embed_tokens.weight", inner.embed_tokens.weight)
            tied = head is inner.embed_tokens.weight or head.data_ptr() == inner.embed_tokens.weight.data_ptr()
            self.head = self._packed(self.embed if tied else self._own("lm_head.weight", head))
        self.eps = float(layer.input_layernorm.variance_epsilon)
        if self.plain_reason is not None:
            log.info("rollout: the decode step's GEMMs are not prepacked (%s)", self.plain_reason)

    def _own(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.pack:  # the model's own tensor, of this dtype
            return tensor.detach()
        copy = tensor.detach().to(self.dtype, copy=True)
        self.views[name] = copy
        return copy

    def _packed(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` in oneDNN's layout where packing is asked for and allowed, else as it is."""
        if not (self.pack or self.widened):
            return weight
        reason = packing_off(self.dtype, weight.device, (weight.shape[0], weight.shape[1]), self.widened)
        if reason is not None:
            self.plain_reason = reason
            return weight
        self.packed += 1
        return pack(weight)

    def _linear(self, name: str, module: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if module.bias is None else self._own(name + ".bias", module.bias)
        if self.widened:  # no plain copy kept: the prefill widens the model's own matrix
            return self._packed(module.weight.detach().to(self.dtype)), bias
        return self._packed(self._own(name + ".weight", module.weight)), bias

    def _fuse(self, prefix: str, parent: Any, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        mods = [getattr(parent, n) for n in names]
        weight = torch.cat([m.weight.detach().to(self.dtype) for m in mods])
        bias = None
        if mods[0].bias is not None:
            bias = torch.cat([m.bias.detach().to(self.dtype) for m in mods])
        if self.pack or self.widened:
            return self._packed(weight), bias
        start = 0
        for n, m in zip(names, mods, strict=True):
            stop = start + m.weight.shape[0]
            self.views[f"{prefix}{n}.weight"] = weight[start:stop]
            if bias is not None:
                self.views[f"{prefix}{n}.bias"] = bias[start:stop]
            start = stop
        return weight, bias

    @contextlib.contextmanager
    def swapped(self, model: Any) -> Iterator[None]:
        """The model's parameters are these copies inside the block (its own tensors are put back after)."""
        saved = {}
        for name, param in model.named_parameters():
            if name in self.views:
                saved[name] = param.data
                param.data = self.views[name]
        try:
            with self._each_module_widened(model) if self.widened else contextlib.nullcontext():
                yield
        finally:
            for name, param in model.named_parameters():
                if name in saved:
                    param.data = saved[name]

    @contextlib.contextmanager
    def _each_module_widened(self, model: Any) -> Iterator[None]:
        """Inside the block each decoder layer has its matrices in `dtype` while it runs and its own after (a
        widened copy keeps its matrices only packed, which the transformers model cannot read); the embedding
        looks its rows up in its own dtype and widens them (exact), and the head is the packed one the decode
        multiplies: widened whole, each was a transient 113 MB fp32 matrix at every prefill (SmolLM2-135M)."""
        own: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

        def widen(module: torch.nn.Module, args: Any) -> None:
            for param in module.parameters():
                if param.dtype != self.dtype:
                    own.append((param, param.data))
                    param.data = param.data.to(self.dtype)

        def restore(*_: Any) -> None:
            while own:
                param, data = own.pop()
                param.data = data

        hooks = [model.model.embed_tokens.register_forward_hook(lambda _m, _a, out: out.to(self.dtype))]
        for module in model.model.layers:
            hooks += [module.register_forward_pre_hook(widen), module.register_forward_hook(restore)]
        head, model.lm_head = model.lm_head, _PackedHead(self.head)
        try:
            yield
        finally:
            model.lm_head = head
            for hook in hooks:
                hook.remove()
            restore()  # a layer that raised: its matrices go back too


class _PackedHead(torch.nn.Module):
    """The rollout weights' (packed) head standing in for a model's `lm_head` while it prefills."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.packed = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """`lm_head(hidden)` on the packed matrix ([..., hidden] -> [..., vocabulary])."""
        return linear(hidden.reshape(-1, hidden.shape[-1]), self.packed).view(*hidden.shape[:-1], -1)
