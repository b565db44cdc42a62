"""Where each Megatron tensor lives: tensor-parallel split/merge, pipeline (and virtual pipeline) layer maps.

TP rules (reference C.4): column-parallel tensors are split on dim 0 (fused QKV is group-major, so a
contiguous chunk is whole query groups; SwiGLU fc1 is split per half), row-parallel on dim 1, vocab tensors
are padded then split on dim 0, everything else (norms, row-parallel biases) is replicated.
PP rules (C.5): stage p owns a contiguous range of layers (even, or Megatron-Core's uneven first / last
stage), stored under local indices; with virtual pipelines model chunk c = v * pp + p. Embedding on the first
chunk, final norm and output layer on the last.
EP rules (Megatron-Core MoE): the routed experts of a layer are split contiguously over the expert-parallel
ranks (EP rank e holds experts [e*n, (e+1)*n) as local experts 0..n-1), each expert TP-split like a dense MLP
over the expert tensor parallel size (TP, or a divisor of it: `ConversionSpec.expert_tp`); everything else, the
router included, is replicated over EP ranks.
Non-goal: knowing any HF name.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rlstages.engines.convert.ops import Converted, RowConcat, StackedParts, materialize

LAYER_PREFIX = "decoder.layers."
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"

# Local-spec suffix -> Transformer Engine spec suffix (TE fuses the pre-norms into the next linear).
TE_NAMES = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".input_layernorm.bias": ".self_attention.linear_qkv.layer_norm_bias",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
    ".pre_mlp_layernorm.bias": ".mlp.linear_fc1.layer_norm_bias",
}
LOCAL_NAMES = {te: local for local, te in TE_NAMES.items()}

_DEFAULT_TP_RULES = {
    EMBEDDING: "vocab",
    OUTPUT_LAYER: "vocab",
    "layer_norm_weight": "replicated",
    "layer_norm_bias": "replicated",
    "linear_qkv.weight": "column",
    "linear_qkv.bias": "column",
    "linear_fc1.weight": "column",
    "linear_fc1.bias": "column",
    "linear_proj.weight": "row",
    "linear_fc2.weight": "row",
    "linear_proj.bias": "replicated",
    "linear_fc2.bias": "replicated",
    "router.weight": "replicated",
    "router.expert_bias": "replicated",
    "linear_q_proj.weight": "column",
    "linear_q_down_proj.weight": "column",
    "linear_q_up_proj.weight": "column",
    "linear_kv_down_proj.weight": "column",
    "linear_kv_up_proj.weight": "column",
}
# Routed experts: SequentialMLP's `experts.local_experts.<E>.` and Transformer Engine grouped GEMM's
# `experts.linear_fc1.weight<E>` (TEGroupedMLP: one parameter per local expert).
_LOCAL_EXPERT = re.compile(r"^(?P<head>.*\.experts\.local_experts\.)(?P<index>\d+)(?P<tail>\..*)$")
_GROUPED_EXPERT = re.compile(r"^(?P<head>.*\.experts\.linear_fc[12]\.(?:weight|bias))(?P<index>\d+)(?P<tail>)$")


def expert_index(name: str) -> tuple[str, int, str] | None:
    """(head, expert index, tail) of a routed-expert Megatron name; None for any other tensor."""
    for pattern in (_LOCAL_EXPERT, _GROUPED_EXPERT):
        m = pattern.match(name)
        if m:
            return m["head"], int(m["index"]), m["tail"]
    return None


def split_ep(name: str, experts_per_rank: int, ep: int) -> list[tuple[int, str]]:
    """The (EP rank, name there) pairs that hold a global Megatron tensor: a routed expert lives on one EP rank
    under its local index; every other tensor is replicated on all `ep` ranks."""
    found = expert_index(name)
    if found is None or ep == 1:
        return [(e, name) for e in range(ep)]
    head, index, tail = found
    rank, local = divmod(index, experts_per_rank)
    return [(rank, f"{head}{local}{tail}")]


def global_expert_name(name: str, ep_rank: int, experts_per_rank: int) -> str:
    """A rank's local routed-expert name -> its global name (other names unchanged); inverse of `split_ep`."""
    found = expert_index(name)
    if found is None:
        return name
    head, local, tail = found
    return f"{head}{ep_rank * experts_per_rank + local}{tail}"


# MLA under Transformer Engine: the q/kv norms fuse into the up-projections that follow them.
TE_MLA_NAMES = {
    ".self_attention.q_layernorm.weight": ".self_attention.linear_q_up_proj.layer_norm_weight",
    ".self_attention.kv_layernorm.weight": ".self_attention.linear_kv_up_proj.layer_norm_weight",
}
_PRE_MLP = (".pre_mlp_layernorm.weight", ".pre_mlp_layernorm.bias")
_LOCAL_EXPERT_LINEAR = re.compile(r"\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_GROUPED_EXPERT_LINEAR = re.compile(r"\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


def to_te_name(name: str, *, moe_layer: bool = False, mla: bool = False, grouped_experts: bool = False) -> str:
    """Local-spec Megatron name -> Transformer Engine spec name (unchanged when TE names it the same).

    In an MoE layer the pre-MLP norm stays separate (TE fuses it only into a dense fc1); with MLA the q/kv norms
    fuse into the up-projections; `grouped_experts` gives TEGroupedMLP's `experts.linear_fc1.weight<E>`.
    """
    m = _LOCAL_EXPERT_LINEAR.search(name)
    if grouped_experts and m:
        return f"{name[: m.start()]}.experts.{m[2]}.{m[3]}{m[1]}"
    table = {**TE_NAMES, **(TE_MLA_NAMES if mla else {})}
    for local, te in table.items():
        if name.endswith(local) and not (moe_layer and local in _PRE_MLP):
            return name[: -len(local)] + te
    return name


def to_local_name(name: str) -> str:
    """Transformer Engine spec name -> local-spec name (unchanged when not a fused norm or grouped expert)."""
    m = _GROUPED_EXPERT_LINEAR.search(name)
    if m:
        return f"{name[: m.start()]}.experts.local_experts.{m[3]}.{m[1]}.{m[2]}"
    for te, local in (*LOCAL_NAMES.items(), *((te, loc) for loc, te in TE_MLA_NAMES.items())):
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def tp_kind(name: str, rules: Mapping[str, str] | None = None) -> str:
    """TP class of a Megatron tensor name: column, row, vocab or replicated (template rules first; a rule with
    `*` is a glob over the whole name, the others are name suffixes)."""
    for pattern, kind in (rules or {}).items():
        if "*" in pattern and fnmatch.fnmatchcase(name, pattern):
            return kind
    name = re.sub(r"(\.experts\.linear_fc[12]\.(?:weight|bias))\d+$", r"\1", name)  # TE grouped GEMM
    for table in (rules or {}, _DEFAULT_TP_RULES):
        for suffix, kind in table.items():
            if name.endswith(suffix):
                return kind
    if "norm" in name.rsplit(".", 2)[-2]:
        return "replicated"
    raise KeyError(f"{name}: no tensor-parallel rule; add tp_rules={{'<suffix>': 'column'|'row'|...}} to its template")


def pad_vocab(tensor: Converted, padded_rows: int) -> Converted:
    """Append zero rows so dim 0 has `padded_rows` rows (Megatron needs the vocab divisible by TP)."""
    extra = padded_rows - tensor.shape[0]
    if extra < 0:
        raise ValueError(f"vocab tensor has {tensor.shape[0]} rows, more than padded_vocab_size={padded_rows}")
    if extra == 0:
        return tensor
    tensor = materialize(tensor)
    return RowConcat((tensor, tensor.new_zeros((extra, *tensor.shape[1:]))))


def split_tp(name: str, tensor: Converted, kind: str, tp: int) -> list[torch.Tensor | RowConcat]:
    """One global Megatron tensor -> its `tp` rank shards (views or unmaterialised row pieces where possible)."""
    if isinstance(tensor, StackedParts):
        if tp == 1 or kind == "replicated":
            return [RowConcat(tensor.parts) if tensor.dim == 0 else tensor.merged()] * tp
        if kind != "column":
            raise ValueError(f"{name}: stacked (per-part) tensors must be column-parallel, the rule says {kind!r}")
        per_part = [_chunk(name, p, 0, tp) for p in tensor.parts]
        if tensor.dim == 0:
            return [RowConcat(tuple(chunks[r] for chunks in per_part)) for r in range(tp)]
        return [torch.cat([chunks[r] for chunks in per_part], dim=tensor.dim) for r in range(tp)]
    if tp == 1 or kind == "replicated":
        return [tensor] * tp
    if isinstance(tensor, RowConcat):
        if kind == "row":
            return list[torch.Tensor | RowConcat](_chunk(name, tensor.materialize(), 1, tp))
        if tensor.shape[0] % tp:
            raise ValueError(
                f"{name}: dim 0 of shape {tuple(tensor.shape)} is not divisible by tensor parallel size {tp}"
            )
        return list(tensor.chunk(tp))
    return list[torch.Tensor | RowConcat](_chunk(name, tensor, 1 if kind == "row" else 0, tp))


def _chunk(name: str, tensor: torch.Tensor, dim: int, tp: int) -> list[torch.Tensor]:
    if tensor.shape[dim] % tp:
        raise ValueError(
            f"{name}: dim {dim} of shape {tuple(tensor.shape)} is not divisible by tensor parallel size {tp}"
        )
    return list(tensor.chunk(tp, dim=dim))


def merge_tp(name: str, shards: Sequence[torch.Tensor], kind: str, stacked_parts: int | None = None) -> torch.Tensor:
    """TP rank shards -> the global Megatron tensor (inverse of `split_tp`; replicated takes rank 0)."""
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind == "row":
        return torch.cat(list(shards), dim=1)
    if stacked_parts:
        parts = [shard.chunk(stacked_parts, dim=0) for shard in shards]
        return torch.cat([parts[r][p] for p in range(stacked_parts) for r in range(len(shards))], dim=0)
    return torch.cat(list(shards), dim=0)


@dataclass(frozen=True)
class Placement:
    """Where a Megatron tensor lives: pipeline stage, virtual-pipeline chunk and its local name there."""

    pp_rank: int
    vp_stage: int
    local_name: str


@dataclass(frozen=True)
class LayerMap:
    """Split of `num_layers` over `pp` stages x `vpp` virtual chunks (reference C.5): even, or Megatron-Core's
    uneven first / last stage (`first` / `last` layers there, the middle stages share the rest evenly; each
    stage's layers split evenly over its `vpp` chunks). Model order: chunk c = v * pp + p."""

    num_layers: int
    pp: int = 1
    vpp: int = 1
    first: int | None = None
    last: int | None = None

    def __post_init__(self) -> None:
        if self.first is None and self.last is None:
            if self.num_layers % (self.pp * self.vpp):
                raise ValueError(
                    f"num_layers={self.num_layers} is not divisible by pipeline stages x virtual chunks = "
                    f"{self.pp} x {self.vpp}; choose pp/vpp that divide the layer count"
                )
            return
        stages = self.stage_layers()
        if self.pp < 2 or min(stages) < 1 or any(n % self.vpp for n in stages):
            raise ValueError(
                f"uneven pipeline stages first={self.first} last={self.last}: {self.num_layers} layers over pp="
                f"{self.pp} give stages {stages}; every stage needs >= 1 layer, a multiple of vpp={self.vpp}"
            )

    def stage_layers(self) -> list[int]:
        """Layers of each pipeline stage (its virtual chunks together)."""
        fixed = [n for n in (self.first, self.last) if n is not None]
        middle = self.pp - len(fixed)
        rest = self.num_layers - sum(fixed)
        if middle < 0 or rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
            raise ValueError(
                f"uneven pipeline stages: {self.num_layers} layers minus first={self.first} / last={self.last} do "
                f"not split evenly over the other {max(middle, 0)} of pp={self.pp} stages"
            )
        stages = [rest // middle if middle else 0] * self.pp
        if self.first is not None:
            stages[0] = self.first
        if self.last is not None:
            stages[-1] = self.last
        return stages

    @property
    def uneven(self) -> bool:
        """The first or last stage has its own layer count."""
        return self.first is not None or self.last is not None

    @property
    def layers_per_chunk(self) -> int:
        """Layers in each model chunk (even split only)."""
        if self.uneven:
            raise ValueError("layers_per_chunk: the pipeline stages are uneven; use chunk_layers()")
        return self.num_layers // (self.pp * self.vpp)

    def chunk_layers(self) -> list[tuple[int, int]]:
        """(first global layer, layer count) of each model chunk, in model order (chunk c = v * pp + p)."""
        return list(self._spans)

    @functools.cached_property
    def _spans(self) -> tuple[tuple[int, int], ...]:
        sizes = [n // self.vpp for n in self.stage_layers()] * self.vpp
        return tuple((sum(sizes[:c]), n) for c, n in enumerate(sizes))

    def chunks(self) -> list[tuple[int, int]]:
        """All (pp_rank, vp_stage) pairs in model order."""
        return [(c % self.pp, c // self.pp) for c in range(self.pp * self.vpp)]

    def place(self, name: str, *, first_stage_default: bool = True) -> Placement:
        """Placement of a global Megatron name (layer names get their chunk-local index)."""
        if name.startswith(LAYER_PREFIX):
            index, _, rest = name[len(LAYER_PREFIX) :].partition(".")
            layer = int(index)
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"{name}: layer {layer} is outside 0..{self.num_layers - 1}")
            chunk, local = next((c, layer - s) for c, (s, n) in enumerate(self._spans) if layer < s + n)
            return Placement(chunk % self.pp, chunk // self.pp, f"{LAYER_PREFIX}{local}.{rest}")
        if name.startswith("decoder.final_layernorm") or name.startswith("output_layer"):
            return Placement(self.pp - 1, self.vpp - 1, name)
        return Placement(0, 0, name)

    def global_name(self, local_name: str, pp_rank: int, vp_stage: int = 0) -> str:
        """Global Megatron name of a chunk-local name (inverse of `place`)."""
        if not local_name.startswith(LAYER_PREFIX):
            return local_name
        index, _, rest = local_name[len(LAYER_PREFIX) :].partition(".")
        start, _ = self._spans[vp_stage * self.pp + pp_rank]
        return f"{LAYER_PREFIX}{start + int(index)}.{rest}"


def chunk_prefix(vp_stage: int, vpp: int) -> str:
    """Name prefix of a virtual-pipeline chunk inside a rank file ("model<v>." as Megatron's legacy keys)."""
    return f"model{vp_stage}." if vpp > 1 else ""
