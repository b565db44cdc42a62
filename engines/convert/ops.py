"""Weight ops: the invertible steps that turn HF tensors into Megatron-Core tensors and back.

An op names its HF inputs and its Megatron outputs. A name that starts with "." is a layer-local suffix
(it follows `model.layers.<i>` on the HF side and `decoder.layers.<i>` on the Megatron side); any other
name is a whole tensor name. `{}` is a wildcard that matches one or more characters and carries its value
to the other side (e.g. `Rename("visual.{}", "vision_model.{}")`).

Ops work on whole (unsharded) tensors; splitting over tensor/pipeline ranks is `sharding`'s job. They
must also work on `meta` tensors, because a conversion is planned on meta tensors before any byte is read.
Non-goal: knowing about files, ranks or models.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionDims:
    """Head counts the fused-QKV layout depends on: `heads` query heads in `groups` KV groups of `head_dim`."""

    heads: int
    groups: int
    head_dim: int


@dataclass(frozen=True)
class StackedParts:
    """Parts kept separate so TP splits each one (SwiGLU gate/up); `merged()` is the single-rank tensor."""

    parts: tuple[torch.Tensor, ...]
    dim: int = 0

    def merged(self) -> torch.Tensor:
        """Concatenate the parts along `dim`."""
        return torch.cat(self.parts, dim=self.dim)

    @property
    def shape(self) -> torch.Size:
        """Shape of the merged tensor."""
        shape = list(self.parts[0].shape)
        shape[self.dim] = sum(p.shape[self.dim] for p in self.parts)
        return torch.Size(shape)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the parts."""
        return self.parts[0].dtype


@dataclass(frozen=True)
class RowConcat:
    """Tensors concatenated along dim 0 but never materialised: written piece by piece, saving a copy.

    Every piece has the same trailing shape; `chunk(n)` splits the rows evenly (for tensor parallelism).
    """

    pieces: tuple[torch.Tensor, ...]

    @property
    def shape(self) -> torch.Size:
        """Shape of the concatenation."""
        return torch.Size([sum(p.shape[0] for p in self.pieces), *self.pieces[0].shape[1:]])

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the pieces."""
        return self.pieces[0].dtype

    def materialize(self) -> torch.Tensor:
        """The concatenated tensor (a copy)."""
        return torch.cat(self.pieces)

    def chunk(self, n: int) -> list[RowConcat]:
        """`n` equal row ranges, each made of (views of) the pieces it covers."""
        rows = self.shape[0] // n
        out, current, need = [], [], rows
        for piece in self.pieces:
            start = 0
            while start < piece.shape[0]:
                take = min(need, piece.shape[0] - start)
                current.append(piece[start : start + take])
                start, need = start + take, need - take
                if need == 0:
                    out.append(RowConcat(tuple(current)))
                    current, need = [], rows
        return out


def materialize(tensor: torch.Tensor | StackedParts | RowConcat) -> torch.Tensor:
    """A plain tensor for any converted value."""
    if isinstance(tensor, StackedParts):
        return tensor.merged()
    return tensor.materialize() if isinstance(tensor, RowConcat) else tensor


Converted = torch.Tensor | StackedParts | RowConcat


def _names(names: str | Sequence[str]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


def _compile(name: str) -> re.Pattern[str]:
    return re.compile("(.+?)".join(re.escape(part) for part in name.split("{}")))


def fill(name: str, values: Sequence[str]) -> str:
    """Put wildcard values into the `{}` slots of `name`."""
    for value in values:
        name = name.replace("{}", value, 1)
    return name


class WeightOp:
    """Base of all ops: `hf_names` in, `mcore_names` out.

    `when` names an mcore-config flag that enables the op (e.g. "add_qkv_bias"); `optional=True` means its
    tensors may be absent without that being a completeness error. `layers` limits a layer op to the dense
    ("dense") or Mixture-of-Experts ("moe") layers of the model; a "moe" op with a `{}` wildcard ranges over the
    expert indices (so completeness is checked expert by expert).
    """

    def __init__(
        self,
        hf_names: str | Sequence[str],
        mcore_names: str | Sequence[str],
        *,
        when: str | None = None,
        optional: bool = False,
        layers: str | None = None,
    ) -> None:
        self.hf_names = _names(hf_names)
        self.mcore_names = _names(mcore_names)
        self.when = when
        self.optional = optional
        if layers not in (None, "dense", "moe"):
            raise ValueError(f"{type(self).__name__}: layers must be None, 'dense' or 'moe', got {layers!r}")
        self.layers = layers
        names = (*self.hf_names, *self.mcore_names)
        if not names:
            raise ValueError(f"{type(self).__name__}: needs at least one name")
        if len({n.startswith(".") for n in names}) > 1:
            raise ValueError(f"{self!r}: names mix layer suffixes ('.x') and whole names")
        if len({n.count("{}") for n in names}) > 1:
            raise ValueError(f"{self!r}: every name needs the same number of '{{}}' wildcards")
        self._patterns = {
            "hf": tuple(_compile(n) for n in self.hf_names),
            "mcore": tuple(_compile(n) for n in self.mcore_names),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self.hf_names)} <-> {list(self.mcore_names)})"

    @property
    def is_layer_op(self) -> bool:
        """True when the names are layer-local suffixes."""
        return (*self.hf_names, *self.mcore_names)[0].startswith(".")

    @property
    def has_wildcard(self) -> bool:
        """True when the names contain `{}`."""
        return "{}" in (*self.hf_names, *self.mcore_names)[0]

    def match(self, side: str, name: str) -> tuple[int, tuple[str, ...]] | None:
        """Which slot of `side` ("hf" or "mcore") `name` fills, with the wildcard values; None if no match."""
        for slot, pattern in enumerate(self._patterns[side]):
            m = pattern.fullmatch(name)
            if m:
                return slot, m.groups()
        return None

    def to_mcore(self, tensors: Sequence[torch.Tensor], dims: AttentionDims) -> list[Converted]:
        """HF tensors (in `hf_names` order) -> Megatron tensors (in `mcore_names` order)."""
        raise NotImplementedError

    def to_hf(self, tensors: Sequence[torch.Tensor], dims: AttentionDims) -> list[torch.Tensor]:
        """Megatron tensors (in `mcore_names` order) -> HF tensors (in `hf_names` order)."""
        raise NotImplementedError


class Rename(WeightOp):
    """One tensor, new name, same bytes."""

    def __init__(
        self,
        hf_names: str,
        mcore_names: str,
        *,
        when: str | None = None,
        optional: bool = False,
        layers: str | None = None,
    ):
        super().__init__(hf_names, mcore_names, when=when, optional=optional, layers=layers)
        if len(self.hf_names) != 1 or len(self.mcore_names) != 1:
            raise ValueError(f"{self!r}: Rename maps exactly one name to one name")

    def to_mcore(self, tensors: Sequence[torch.Tensor], dims: AttentionDims) -> list[Converted]:
        """Identity."""
        return [tensors[0]]

    def to_hf(self, tensors: Sequence[torch.Tensor], dims: AttentionDims) -> list[torch.Tensor]:
        """Identity."""
        return [tensors[0]]


class Drop(WeightOp):
    """Tensors that exist on one side only (e.g. rotary `inv_freq` buffers): consumed, never emitted."""

    def __init__(self, hf_names: str | Sequence[str] = (), mcore_names: str | Sequence[str] = ()):
        super().__init__(hf_names, mcore_names, optional=True)

    def to_mcore(self, tensors: Sequence[torch.Tensor], dims: AttentionDims) -> list[Converted]:
        """Nothing."""
        return []

    def to_hf(self, tensors: Sequence[torch.Tensor], dims: AttentionDims) -> list[torch.Tensor]:
        """Nothing."""
        return []


class Concat(WeightOp):
    """Several HF tensors -> one Megatron tensor concatenated on `dim`; TP splits the result as one tensor.

    The reverse splits into equal parts, so the HF tensors must have equal sizes along `dim`.
    """

    def __init__(
        self,
        hf_names: Sequence[str],
        mcore_names: str,
        dim: int = 0,
        *,
        when: str | None = None,
        layers: str | None = None,
    ):
        super().__init__(hf_names, mcore_names, when=when, layers=layers)
        self.dim = dim

    def to_mcore(self, tensors: Sequence[torch.Tensor], dims: AttentionDims) -> list[Converted]:
        """Concatenate on `dim`."""
        return [torch.cat(list(tensors), dim=self.dim)]

    def to_hf(self, tensors: Sequence[torch.Tensor], dims: AttentionDims) -> list[torch.Tensor]:
        """Split into equal parts on `dim`."""
        return [t.contiguous() for t in tensors[0].chunk(len(self.hf_names), dim=self.dim)]


class Stack(Concat):
    """Several HF tensors -> one Megatron tensor whose parts TP splits one by one (SwiGLU gate/up -> fc1)."""

    def to_mcore(self, tensors: Sequence[torch.Tensor], dims: AttentionDims) -> list[Converted]:
        """Keep the parts (merged only when written to a rank)."""
        return [StackedParts(tuple(tensors), self.dim)]


class QKV(WeightOp):
    """q, k, v projections -> Megatron's grouped layout: per query group its q heads, then its k, then its v."""

    def __init__(self, hf_names: Sequence[str], mcore_names: str, *, when: str | None = None):
        super().__init__(hf_names, mcore_names, when=when)
        if len(self.hf_names) != 3 or len(self.mcore_names) != 1:
            raise ValueError(f"{self!r}: needs exactly 3 hf_names (q, k, v) and one mcore name")

    def to_mcore(self, tensors: Sequence[torch.Tensor], dims: AttentionDims) -> list[Converted]:
        """Interleave per group: [q heads of g, k_g, v_g] for each group g."""
        q, k, v = tensors
        g, d = dims.groups, dims.head_dim
        for name, t, rows in zip(self.hf_names, (q, k, v), (dims.heads * d, g * d, g * d), strict=True):
            if t.shape[0] != rows:
                raise ValueError(
                    f"{name}: expected {rows} rows (heads x head_dim of the config), got shape {tuple(t.shape)}"
                )
        qs = q.shape[0] // g
        pieces = [
            t for i in range(g) for t in (q[i * qs : (i + 1) * qs], k[i * d : (i + 1) * d], v[i * d : (i + 1) * d])
        ]
        return [RowConcat(tuple(pieces))]

    def to_hf(self, tensors: Sequence[torch.Tensor], dims: AttentionDims) -> list[torch.Tensor]:
        """Undo the grouping: split each group into its q heads, k and v."""
        (qkv,) = tensors
        g, d = dims.groups, dims.head_dim
        r = dims.heads // g
        rest = qkv.shape[1:]
        if qkv.shape[0] != (r + 2) * d * g:
            raise ValueError(f"{self.mcore_names[0]}: expected {(r + 2) * d * g} rows, got {tuple(qkv.shape)}")
        q, k, v = qkv.reshape(g, (r + 2) * d, *rest).split([r * d, d, d], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


class QKVBias(QKV):
    """The same grouped layout for the 1-D q/k/v biases (Qwen2; Llama with `attention_bias`)."""
